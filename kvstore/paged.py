"""Paged KV-cache layouts and the transfer core shared by every engine adapter.

An engine keeps each layer's KV in a paged tensor: token slot ``s = block_id * block_size +
offset``. A ``PagedLayout`` says how one layer's tensor maps slots to memory and copies the KV
of a list of slots to or from a contiguous *staging* tensor of ``chunk_shape(cache, n)``:

* ``gather(cache, slots, out)``: the KV of ``slots`` into ``out`` (cache unchanged);
* ``scatter(cache, slots, src)``: ``src`` into the cache at ``slots`` (the inverse);
* ``name``: recorded in the ``Namespace`` (``layout``), so differently laid-out bytes never
  share a key; ``granularity``: ``"token"`` (any slot list) or ``"block"`` (whole blocks only).

Block-granular layouts (pages whose contents are opaque, e.g. vLLM's CPU attention packing)
take the slots of whole blocks only: ``len(slots)`` a multiple of ``block_size`` and each run of
``block_size`` slots one block in order; they copy pages as opaque bytes.

Copies are vectorised, never a Python loop per token or block. On the CPU they are numpy
``take(out=)`` / fancy assignment over opaque *items*: one token's row or, when the slots are
whole blocks in order (a 256-token chunk at block size 16 is 16 blocks), one whole block.
numpy moves each item with one ``memcpy``, at any alignment, on the calling thread. Measured
on a shared 2-core host (benchmarks/results/paged.md), one thread: 0.6-0.8 of a same-size
memcpy for gather and scatter, where torch reached 0.38-0.86 and 0.49-0.62. With both cores
free torch's two threads copied a whole prompt faster for some layouts, but its intra-op pool
stalled (0.01-0.1 of memcpy) whenever the cores were shared; this path never waits on a pool.
On other devices the copies are ``index_select(out=)`` / ``index_copy_`` (on an int64 view of
the rows where the strides allow). Layouts accept arbitrary strides (vLLM hands GPU backends a
permuted, non-contiguous view); where slots cannot be addressed as one merged dimension they
fall back to advanced indexing, which is correct but slower.

``KVTransfer`` is the engine-agnostic core the agent API and the vLLM connector both use: per
sequence (tokens, slots) it saves chunks through a ``PrefixCache`` (gather -> staging ->
record) and loads the longest stored prefix back (verified record -> scatter; on the CPU
straight from the record's bytes, on an accelerator through pinned staging).
"""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod
from typing import Literal, NamedTuple, Sequence

import numpy as np
import torch

from kvstore.keys import ChunkKey, Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import Record

log = logging.getLogger(__name__)

__all__ = [
    "PagedLayout", "FlashLayout", "BHNCLayout", "CPUPackedLayout", "MLALayout", "LAYOUTS",
    "get_layout", "dtype_name", "StagingPool", "KVTransfer", "slots_from_block_table",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names records use)."""
    return str(dtype).removeprefix("torch.")


def slots_from_block_table(block_ids: Sequence[int] | torch.Tensor, block_size: int, num_tokens: int,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """Slots of the first ``num_tokens`` tokens of a sequence whose blocks are ``block_ids``."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    slots = (ids[:, None] * block_size + torch.arange(block_size, device=ids.device)).flatten()
    if slots.numel() < num_tokens:
        raise ValueError(f"{ids.numel()} blocks of {block_size} hold {slots.numel()} tokens, not {num_tokens}")
    return slots[:num_tokens]


def _try_view(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor | None:
    try:
        return t.view(*shape)
    except RuntimeError:  # strides cannot be merged without a copy
        return None


def _as_int64(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` reinterpreted as int64 along its last dim (fewer, wider elements copy faster)."""
    if t.dtype == torch.int64:
        return t
    if t.dim() == 0 or t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 8:
        return None
    try:
        v = t.view(torch.int64)
    except RuntimeError:
        return None
    return v if v.data_ptr() % 8 == 0 else None


class _HostLayer(NamedTuple):
    """One CPU layer's cache as numpy arrays of opaque items, sharing its memory: ``tokens``
    ``[*lead, num_slots]`` (one token's row each) and ``blocks`` ``[*lead, num_blocks]`` (one
    whole block each); either is None where the layout or the strides do not allow it."""

    tokens: np.ndarray | None
    blocks: np.ndarray | None
    block_size: int


def _np_items(t: torch.Tensor | np.ndarray) -> np.ndarray | None:
    """A ``[..., n, m]`` CPU tensor or array (last dim contiguous) as a numpy ``[..., n]`` array
    of items of ``m`` elements each, sharing its memory; None where the strides forbid it."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu" or t.dim() == 0 or t.shape[-1] == 0 or t.stride(-1) != 1:
            return None
        try:
            t = t.detach().view(torch.uint8).numpy()
        except (RuntimeError, TypeError):
            return None
    try:
        return t.view(np.dtype((np.void, t.shape[-1])))[..., 0]
    except ValueError:  # the last axis is not contiguous
        return None


def _host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a C-contiguous CPU tensor as a flat numpy uint8 array (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


@functools.lru_cache(maxsize=16)
def _offsets(block_size: int) -> np.ndarray:
    offsets = np.arange(block_size, dtype=np.int64)
    offsets.setflags(write=False)  # shared by every caller
    return offsets


def _whole_blocks(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The block ids of ``slots`` if they are whole blocks, each in order; None otherwise."""
    if slots.size == 0 or slots.size % block_size:
        return None
    starts = slots.reshape(-1, block_size) - _offsets(block_size)  # rows are constant for whole blocks
    first = starts[:, 0]
    if (first % block_size).any() or not (starts == first[:, None]).all():
        return None
    return first // block_size


def _host_copy(layers: Sequence[_HostLayer], slots: torch.Tensor, staging: np.ndarray, to_cache: bool,
               skip: int = 0) -> bool:
    """Copy ``slots[skip:]`` between every layer's cache and ``staging`` (the bytes of a staging
    tensor ``[len(layers), *chunk_shape(len(slots))]``, any alignment, read-only unless copying
    from the cache), as whole blocks where they are, else as token rows. All layers alike
    (one shape). False, having copied nothing, where the items do not allow it."""
    if not layers or slots.device.type != "cpu":
        return False
    first, bs, n = layers[0], layers[0].block_size, slots.numel()
    rest = slots[skip:].numpy()
    idx = _whole_blocks(rest, bs) if first.blocks is not None and skip % bs == 0 and n % bs == 0 else None
    if idx is not None:
        kind, n_items, skip_items = "blocks", n // bs, skip // bs
    elif first.tokens is not None:
        kind, idx, n_items, skip_items = "tokens", rest, n, skip
    else:
        return False
    items = getattr(first, kind)
    size = items.shape[-1]
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        bad = idx[(idx < 0) | (idx >= size)][0]
        raise IndexError(f"{kind[:-1]} {bad} is out of range for a cache of {size} {kind}")
    shape = (len(layers), *items.shape[:-1], n_items, items.dtype.itemsize)
    if staging.size != math.prod(shape):
        raise ValueError(f"staging of {staging.size} bytes does not hold {n} slots of {len(layers)} layers")
    staged = _np_items(staging.reshape(shape))[..., skip_items:]
    for layer, part in zip(layers, staged):
        cache_items = getattr(layer, kind)
        pairs = zip(cache_items, part) if cache_items.ndim == 2 else ((cache_items, part),)
        for c, st in pairs:
            if to_cache:
                c[idx] = st
            else:  # mode="raise" would buffer the whole output; the range is checked above
                np.take(c, idx, out=st, mode="clip")
    return True


def _host_layers(layout: "PagedLayout", caches: Sequence[torch.Tensor]) -> list[_HostLayer] | None:
    """Item views of every layer, with only the kinds that all layers have; None if none."""
    layers = [layout._host_layer(c) for c in caches]
    if not layers or any(h is None for h in layers):
        return None
    tokens = all(h.tokens is not None for h in layers)
    blocks = all(h.blocks is not None for h in layers)
    if not (tokens or blocks):
        return None
    return [h._replace(tokens=h.tokens if tokens else None, blocks=h.blocks if blocks else None) for h in layers]


class PagedLayout(ABC):
    """How one layer's paged KV tensor maps token slots to memory. Stateless; thread-safe."""

    #: Recorded in the namespace: differently laid-out bytes never share a key.
    name: str
    #: ``"token"``: any slots; ``"block"``: the slots of whole blocks only.
    granularity: Literal["token", "block"]

    @abstractmethod
    def block_size(self, cache: torch.Tensor) -> int:
        """Tokens per block of ``cache``."""

    @abstractmethod
    def num_blocks(self, cache: torch.Tensor) -> int:
        """Blocks in ``cache``."""

    @abstractmethod
    def chunk_shape(self, cache: torch.Tensor, num_tokens: int) -> tuple[int, ...]:
        """Shape of the staging tensor holding ``num_tokens`` tokens of one layer."""

    @abstractmethod
    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the KV of ``slots`` (int64, on ``cache.device``) into ``out`` (contiguous,
        ``chunk_shape(cache, len(slots))``, ``cache.dtype``, on ``cache.device``); returns ``out``."""

    @abstractmethod
    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (as ``gather`` writes it) into ``cache`` at ``slots``."""

    def check_slots(self, cache: torch.Tensor, num_tokens: int) -> None:
        """Raise ``ValueError`` if ``num_tokens`` slots cannot be copied by this layout."""

    def _host_layer(self, cache: torch.Tensor) -> _HostLayer | None:
        """``cache`` (on the CPU) as numpy items for ``_host_copy``, in ``chunk_shape`` order;
        None to always use ``gather``/``scatter``."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _TokenLayout(PagedLayout):
    """A token-addressable layout, given as a view ``[*lead, num_blocks, block_size, *row]``."""

    granularity: Literal["token", "block"] = "token"
    _lead = 0  # leading dims before the block dim (flash: 1, the K/V axis)

    @abstractmethod
    def _blocked(self, cache: torch.Tensor) -> torch.Tensor:
        """A view ``[*lead, num_blocks, block_size, *row]`` of ``cache`` (no copy)."""

    def block_size(self, cache: torch.Tensor) -> int:
        return self._blocked(cache).shape[self._lead + 1]

    def num_blocks(self, cache: torch.Tensor) -> int:
        return self._blocked(cache).shape[self._lead]

    def chunk_shape(self, cache: torch.Tensor, num_tokens: int) -> tuple[int, ...]:
        b = self._blocked(cache)
        return (*b.shape[:self._lead], num_tokens, *b.shape[self._lead + 2:])

    def _rows(self, cache: torch.Tensor) -> torch.Tensor | None:
        """``[*lead, num_slots, row_elems]`` view of ``cache``, or None if strides forbid it."""
        b = self._blocked(cache)
        lead = tuple(b.shape[:self._lead])
        nslots = b.shape[self._lead] * b.shape[self._lead + 1]
        return _try_view(b, (*lead, nslots, -1))

    def _pair(self, cache: torch.Tensor, staging: torch.Tensor, n: int):
        rows = self._rows(cache)
        if rows is None:
            return None
        flat = staging.view(*rows.shape[:self._lead], n, -1)
        r64, f64 = _as_int64(rows), _as_int64(flat)
        if r64 is not None and f64 is not None:
            return r64, f64
        return rows, flat

    def _host_layer(self, cache: torch.Tensor) -> _HostLayer | None:
        if cache.device.type != "cpu" or self._lead > 1:  # _host_copy walks at most one lead dim
            return None
        b = self._blocked(cache)
        lead = tuple(b.shape[:self._lead])
        blocks = _try_view(b, (*lead, b.shape[self._lead], -1))
        rows = self._rows(cache)
        host = _HostLayer(None if rows is None else _np_items(rows),
                          None if blocks is None else _np_items(blocks), b.shape[self._lead + 1])
        return host if host.tokens is not None or host.blocks is not None else None

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        host, staging = self._host_layer(cache), _host_bytes(out)
        if host is not None and staging is not None and _host_copy([host], slots, staging, False):
            return out
        pair = self._pair(cache, out, slots.numel())
        if pair is not None:
            torch.index_select(pair[0], self._lead, slots, out=pair[1])
        else:
            b = self._blocked(cache)
            bs = b.shape[self._lead + 1]
            idx = (slice(None),) * self._lead + (slots // bs, slots % bs)
            out.copy_(b[idx])
        return out

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        host, staging = self._host_layer(cache), _host_bytes(src)
        if host is not None and staging is not None and _host_copy([host], slots, staging, True):
            return
        pair = self._pair(cache, src, slots.numel())
        if pair is not None:
            pair[0].index_copy_(self._lead, slots, pair[1])
        else:
            b = self._blocked(cache)
            bs = b.shape[self._lead + 1]
            idx = (slice(None),) * self._lead + (slots // bs, slots % bs)
            b[idx] = src


class FlashLayout(_TokenLayout):
    """vLLM's legacy FlashAttention cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

    Staging: ``[2, n, num_kv_heads, head_size]`` (K then V).
    """

    name = "flash-2bnhd"
    _lead = 1

    def _blocked(self, cache: torch.Tensor) -> torch.Tensor:
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"{self.name} cache must be [2, blocks, block_size, heads, head_size], got {list(cache.shape)}")
        return cache


class BHNCLayout(_TokenLayout):
    """vLLM 0.32's per-layer logical view ``[num_blocks, num_kv_heads, block_size, 2*head_size]``
    as GPU backends use it: ``view[b, :, n]`` is token ``n``'s K|V per head. Any strides: the
    FlashAttention default is physically ``[B][N][H][2D]`` (a permuted view); ``HND`` is
    ``[B][H][N][2D]`` (slower fallback path). Staging: ``[n, num_kv_heads, 2*head_size]``.
    """

    name = "vllm-bhnc"

    def _blocked(self, cache: torch.Tensor) -> torch.Tensor:
        if cache.dim() != 4:
            raise ValueError(f"{self.name} cache must be [blocks, heads, block_size, 2*head_size], got {list(cache.shape)}")
        return cache.transpose(1, 2)


class MLALayout(_TokenLayout):
    """An MLA-style latent cache ``[num_blocks, block_size, latent_dim]``. Staging: ``[n, latent_dim]``."""

    name = "mla-bnl"

    def _blocked(self, cache: torch.Tensor) -> torch.Tensor:
        if cache.dim() != 3:
            raise ValueError(f"{self.name} cache must be [blocks, block_size, latent_dim], got {list(cache.shape)}")
        return cache


class CPUPackedLayout(PagedLayout):
    """vLLM 0.32's CPU attention cache: the view ``[num_blocks, num_kv_heads, block_size,
    2*head_size]`` whose pages the kernel packs in an ISA-specific order (``vec``: K transposed;
    ``amx``: VNNI tiles). Pages are opaque: whole blocks are copied as they are, and the ISA is
    part of ``name`` so pages never move between hosts that pack differently.
    Staging: ``[n // block_size, num_kv_heads, block_size, 2*head_size]``.
    """

    granularity: Literal["token", "block"] = "block"

    def __init__(self, isa: str = "vec") -> None:
        self.isa = isa
        self.name = f"vllm-cpu-{isa}"

    def _check(self, cache: torch.Tensor) -> None:
        if cache.dim() != 4:
            raise ValueError(f"{self.name} cache must be [blocks, heads, block_size, 2*head_size], got {list(cache.shape)}")

    def block_size(self, cache: torch.Tensor) -> int:
        self._check(cache)
        return cache.shape[2]

    def num_blocks(self, cache: torch.Tensor) -> int:
        self._check(cache)
        return cache.shape[0]

    def check_slots(self, cache: torch.Tensor, num_tokens: int) -> None:
        if num_tokens % self.block_size(cache):
            raise ValueError(f"{self.name} copies whole blocks: {num_tokens} tokens is not a multiple "
                             f"of block_size={self.block_size(cache)}")

    def chunk_shape(self, cache: torch.Tensor, num_tokens: int) -> tuple[int, ...]:
        self.check_slots(cache, num_tokens)
        return (num_tokens // cache.shape[2], *cache.shape[1:])

    def _block_ids(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        bs = self.block_size(cache)
        self.check_slots(cache, slots.numel())
        ids = slots[::bs] // bs
        if slots.device.type == "cpu":  # cheap on host; on an accelerator it would force a sync
            expect = (ids[:, None] * bs + torch.arange(bs)).flatten()
            if not torch.equal(expect, slots):
                raise ValueError(f"{self.name} copies whole blocks: slots must cover whole blocks in order")
        return ids

    def _pages(self, cache: torch.Tensor, staging: torch.Tensor):
        pages = _try_view(cache, (cache.shape[0], -1))
        if pages is None:
            return cache, staging
        flat = staging.view(staging.shape[0], -1)
        p64, f64 = _as_int64(pages), _as_int64(flat)
        return (p64, f64) if p64 is not None and f64 is not None else (pages, flat)

    def _host_layer(self, cache: torch.Tensor) -> _HostLayer | None:
        if cache.device.type != "cpu":
            return None
        pages = _try_view(cache, (self.num_blocks(cache), -1))
        blocks = None if pages is None else _np_items(pages)
        return None if blocks is None else _HostLayer(None, blocks, self.block_size(cache))

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ids = self._block_ids(cache, slots)
        host, staging = self._host_layer(cache), _host_bytes(out)
        if host is not None and staging is not None and _host_copy([host], slots, staging, False):
            return out
        pages, flat = self._pages(cache, out)
        torch.index_select(pages, 0, ids, out=flat)
        return out

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        ids = self._block_ids(cache, slots)
        host, staging = self._host_layer(cache), _host_bytes(src)
        if host is not None and staging is not None and _host_copy([host], slots, staging, True):
            return
        pages, flat = self._pages(cache, src)
        pages.index_copy_(0, ids, flat)


#: Layouts by name (``get_layout``); the CPU one for the ``vec`` ISA of this kind of host.
LAYOUTS: dict[str, PagedLayout] = {
    lay.name: lay for lay in (FlashLayout(), BHNCLayout(), MLALayout(), CPUPackedLayout("vec"),
                              CPUPackedLayout("amx"))
}


def get_layout(name: str | PagedLayout) -> PagedLayout:
    """The layout called ``name`` (``ValueError`` naming the accepted ones otherwise)."""
    if isinstance(name, PagedLayout):
        return name
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown KV layout {name!r}; accepted: {', '.join(LAYOUTS)}") from None


class StagingPool:
    """Reusable host staging memory, one growing byte buffer per slot name.

    On CUDA the buffers are pinned so device<->host copies can be asynchronous; on CPU they are
    plain memory (and no CUDA call is made). A tensor handed out is valid until the next
    ``get`` of the same ``name``. Not thread-safe: one pool per transfer.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = bool(pin) and torch.cuda.is_available()
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            # Grow geometrically: a fresh large allocation page-faults (~2.5 GB/s), reuse runs at memcpy speed.
            size = max(nbytes, 0 if buf is None else buf.numel() * 2)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self._bufs[name] = buf
        return buf[:nbytes].view(dtype).view(*shape)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


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
    """

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout | str) -> None:
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
            from kvstore.errors import ConfigError

            raise ConfigError("namespace does not describe the KV cache: " + "; ".join(problems))
        self.on_cuda = self.device.type == "cuda"
        self.pool = StagingPool(pin=self.on_cuda)
        # numpy item views of every layer, built once (CPU caches): per chunk, one index for all layers.
        self._host = _host_layers(self.layout, self.kv_caches) if self.device.type == "cpu" else None
        self._stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    # -- helpers ---------------------------------------------------------------------------
    def usable_tokens(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence this layout can store or load."""
        if self.layout.granularity == "block":
            return num_tokens - num_tokens % self.block_size
        return num_tokens

    def keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int | None = None,
             namespace: Namespace | None = None) -> list[ChunkKey]:
        """Chunk keys of the storable part of ``tokens`` (up to ``max_tokens``), under
        ``namespace`` (default: the cache's; e.g. ``namespace.with_salt(...)`` per tenant)."""
        arr = _token_array(tokens)
        n = self.usable_tokens(arr.shape[0])
        return self.cache.keys(arr[:n], max_tokens=max_tokens, namespace=namespace)

    def _shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        return [self.layout.chunk_shape(self.kv_caches[0], num_tokens)] * len(self.kv_caches)

    def _staging(self, num_tokens: int, device_side: bool = False) -> torch.Tensor:
        shape = (len(self.kv_caches), *self.layout.chunk_shape(self.kv_caches[0], num_tokens))
        if device_side:
            buf = getattr(self, "_dev_buf", None)
            if buf is None or buf.numel() < math.prod(shape):
                self._dev_buf = buf = torch.empty(math.prod(shape), dtype=self.dtype, device=self.device)
            return buf[:math.prod(shape)].view(shape)
        return self.pool.get("kv", shape, self.dtype)

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int | None = None) -> int:
        """Tokens of the longest stored prefix (one lookup round trip; nothing is loaded)."""
        return self.cache.lookup_tokens(self.keys(tokens, max_tokens))

    # -- save ------------------------------------------------------------------------------
    def save_sequence(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, slots: torch.Tensor,
                      hidden_states: torch.Tensor | None = None, start_token: int = 0,
                      namespace: Namespace | None = None) -> int:
        """Store the chunks of ``tokens`` whose KV sits at ``slots`` (one slot per token).

        ``hidden_states[i]`` (optional) is the hidden state of token ``start_token + i``; each
        chunk whose last token has one stores it. Chunks already stored are not rebuilt or
        rewritten. ``namespace`` overrides the cache's (same layout, e.g. another cache salt).
        Returns the number of chunks written (handed to the store).
        """
        arr = _token_array(tokens)
        if slots.numel() < arr.shape[0]:
            raise ValueError(f"{arr.shape[0]} tokens need as many slots, got {slots.numel()}")
        keys = self.keys(arr, namespace=namespace)
        if not keys:
            return 0
        slots = slots.to(self.device, torch.int64)

        def payload(chunk: ChunkKey) -> ChunkPayload:
            staging = self._gather(slots[chunk.start:chunk.end])
            hidden = hidden_dtype = hidden_shape = None
            row = chunk.end - 1 - start_token
            if hidden_states is not None and 0 <= row < hidden_states.shape[0]:
                h = hidden_states[row].detach().to("cpu").contiguous()
                hidden, hidden_dtype, hidden_shape = _tensor_bytes(h), dtype_name(h.dtype), tuple(h.shape)
            return ChunkPayload(shapes=self._shapes(chunk.num_tokens), kv=_tensor_bytes(staging),
                                hidden=hidden, hidden_dtype=hidden_dtype, hidden_shape=hidden_shape)

        return self.cache.save(arr[:keys[-1].end], keys, payload, namespace=namespace)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        n = slots.numel()
        host = self._staging(n)
        if not self.on_cuda:
            if self._host is None or not _host_copy(self._host, slots, _host_bytes(host), False):
                for layer, cache in enumerate(self.kv_caches):
                    self.layout.gather(cache, slots, host[layer])
            return host
        dev = self._staging(n, device_side=True)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for layer, cache in enumerate(self.kv_caches):
                self.layout.gather(cache, slots, dev[layer])
            host.copy_(dev, non_blocking=True)
        stream.synchronize()  # the record encoder reads the host bytes next
        return host

    # -- load ------------------------------------------------------------------------------
    def load_sequence(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, slots: torch.Tensor,
                      max_tokens: int | None = None, *, skip_tokens: int = 0,
                      namespace: Namespace | None = None) -> tuple[int, torch.Tensor | None]:
        """Load the longest stored prefix of ``tokens`` into ``slots``.

        Only chunks ending at or before ``max_tokens`` are considered. Each chunk is verified
        before its KV is scattered. ``skip_tokens`` leading tokens are already in the cache
        (an engine's local prefix hit, possibly shared blocks): chunks ending there are not
        fetched and those slots are never written (``slots`` may hold anything for them); on
        a block-granular layout it must be a whole number of blocks. ``namespace`` overrides
        the cache's. Returns ``(tokens present: skip_tokens or the end of the loaded prefix,
        hidden state of the last loaded token or None)``; the hidden state is a new CPU tensor.
        """
        arr = _token_array(tokens)
        if skip_tokens < 0 or (self.layout.granularity == "block" and skip_tokens % self.block_size):
            raise ValueError(f"skip_tokens={skip_tokens} must be a non-negative multiple of "
                             f"block_size={self.block_size} for {self.layout.name}")
        keys = [k for k in self.keys(arr, max_tokens, namespace=namespace) if k.end > skip_tokens]
        if not keys:
            return min(skip_tokens, arr.shape[0]), None
        n = self.cache.lookup(keys)
        if n == 0:
            return min(skip_tokens, arr.shape[0]), None
        keys = keys[:n]
        slots = slots.to(self.device, torch.int64)

        def sink(chunk: ChunkKey, record: Record) -> None:
            self._scatter(slots[chunk.start:chunk.end], record.kv, max(0, skip_tokens - chunk.start))

        result = self.cache.load(arr[:keys[-1].end], keys, sink,
                                 shapes=lambda c: self._shapes(c.num_tokens), namespace=namespace)
        if self.on_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        hidden = None
        rec = result.last_record
        if result.num_tokens and rec is not None and rec.hidden is not None and rec.header.hidden_shape is not None:
            dt = getattr(torch, rec.header.hidden_dtype or "", None)
            if isinstance(dt, torch.dtype):
                hidden = torch.frombuffer(bytearray(rec.hidden), dtype=dt).view(rec.header.hidden_shape)
        return (result.num_tokens if result.num_tokens else min(skip_tokens, arr.shape[0])), hidden

    def _token_rows(self, staging: torch.Tensor, num_tokens: int, skip: int) -> torch.Tensor:
        """The part of one layer's staging (``chunk_shape(num_tokens)``) after its first ``skip`` tokens."""
        full = self.layout.chunk_shape(self.kv_caches[0], num_tokens)
        rest = self.layout.chunk_shape(self.kv_caches[0], num_tokens - skip)
        axis = next(i for i, (a, b) in enumerate(zip(full, rest)) if a != b)
        return staging.narrow(axis, full[axis] - rest[axis], rest[axis]).contiguous()

    def _scatter(self, slots: torch.Tensor, kv: memoryview | bytes, skip: int = 0) -> None:
        n = slots.numel()
        # On the CPU, straight from the record's bytes (numpy items have no alignment needs).
        if self._host is not None and _host_copy(self._host, slots, np.frombuffer(kv, dtype=np.uint8), True, skip):
            return
        host = self._staging(n)
        # Copy into our staging first: record bytes are read-only and not necessarily 8-byte aligned.
        np.copyto(host.view(-1).view(torch.uint8).numpy(), np.frombuffer(kv, dtype=np.uint8))
        if skip:  # the chunk's first tokens are already in the cache: write only the rest
            for layer, cache in enumerate(self.kv_caches):
                self.layout.scatter(cache, slots[skip:], self._token_rows(host[layer], n, skip).to(self.device))
            if self.on_cuda:
                torch.cuda.current_stream(self.device).synchronize()
            return
        if not self.on_cuda:
            for layer, cache in enumerate(self.kv_caches):
                self.layout.scatter(cache, slots, host[layer])
            return
        dev = self._staging(n, device_side=True)
        # As in _gather: work already queued on the compute stream (on these blocks, or on the
        # memory the allocator just handed ``dev``) must finish before the side stream writes.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dev.copy_(host, non_blocking=True)
            for layer, cache in enumerate(self.kv_caches):
                self.layout.scatter(cache, slots, dev[layer])
        self._stream.synchronize()  # host staging is reused by the next chunk


def _token_array(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    return np.ascontiguousarray(np.asarray(tokens), dtype="<u4")
