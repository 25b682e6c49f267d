"""Paged KV-cache layouts: how one layer's paged tensor maps token slots to memory.

An engine keeps each layer's KV in a paged tensor: token slot ``s = block_id * block_size +
offset``. A ``PagedLayout`` copies the KV of a list of slots to or from a contiguous *staging*
tensor of ``chunk_shape(cache, n)``:

* ``gather(cache, slots, out)``: the KV of ``slots`` into ``out`` (cache unchanged);
* ``scatter(cache, slots, src)``: ``src`` into the cache at ``slots`` (the inverse);
* ``gather_chunks`` / ``scatter_chunks``: the same for ``k`` chunks of ``n`` tokens at once, in
  a staging of ``[k, *chunk_shape(n)]`` (one record's layer after another's, as the device path
  moves whole records): one pass over the cache per layer, whatever ``k``;
* ``name``: recorded in the ``Namespace`` (``layout``), so differently laid-out bytes never
  share a key; ``granularity``: ``"token"`` (any slot list) or ``"block"`` (whole blocks only).

**KV heads.** Attention layouts hold each token's KV per KV head along one axis of the cache and
of the staging (``head_axes``; MLA's latent has none), so a record may hold a range of heads
(``kvstore.keys.HeadRange``) and a reader holding other heads copies only the heads both hold
(``record_shape``: a record of ``h`` heads; ``narrow_heads``: the cache's or the staging's
view of some heads, which ``scatter`` and ``scatter_chunks`` accept like any strided cache). On
vLLM's CPU pages a head's page is a whole item of each block, so this holds there too.

Block-granular layouts (pages whose contents are opaque, e.g. vLLM's CPU attention packing)
take the slots of whole blocks only: ``len(slots)`` a multiple of ``block_size`` and each run of
``block_size`` slots one block in order; they copy pages as opaque bytes.

``gather``/``scatter`` are vectorised torch copies on any device (``index_select(out=)`` /
``index_copy_``, on an int64 view of the rows where the strides allow), never a Python loop per
token or block. Layouts accept arbitrary strides (vLLM hands GPU backends a permuted,
non-contiguous view); where slots cannot be addressed as one merged dimension they fall back to
advanced indexing, which is correct but slower. ``host_layer`` exposes a CPU cache to the numpy
kernels (``kvstore.paged.kernels``), which ``KVTransfer`` prefers on the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from kvstore.paged.kernels import HostLayer, np_items
from kvstore.paged.tensors import as_int64, try_view

__all__ = ["PagedLayout", "FlashLayout", "BHNCLayout", "CPUPackedLayout", "MLALayout", "LAYOUTS", "get_layout",
           "HeadSlice"]


@dataclass(frozen=True)
class HeadSlice:
    """What a load copies of a record of ``record_heads`` KV heads into a cache holding others:
    ``count`` heads from the record's head ``src_at`` into the cache's head ``dst_at``."""

    record_heads: int
    src_at: int
    dst_at: int
    count: int


def _check_range(index: torch.Tensor, size: int, what: str) -> None:
    """``IndexError`` for an index outside ``[0, size)`` (checked on the host only: on an
    accelerator the check would force a synchronisation)."""
    if index.device.type == "cpu" and index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= size:
            raise IndexError(f"{what} {lo if lo < 0 else hi} is out of range for a cache of {size} {what}s")


class PagedLayout(ABC):
    """How one layer's paged KV tensor maps token slots to memory. Stateless; thread-safe."""

    #: Recorded in the namespace: differently laid-out bytes never share a key.
    name: str
    #: ``"token"``: any slots; ``"block"``: the slots of whole blocks only.
    granularity: Literal["token", "block"]
    #: ``(cache axis, chunk_shape axis)`` along which KV heads lie; None: not cut by head.
    head_axes: tuple[int, int] | None = None
    #: Whether each block's bytes are its heads' pages one after another (vLLM CPU's pages), so
    #: that a head range of a block is one run of its bytes (records of other heads land there).
    head_pages = False

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

    def token_axis(self, cache: torch.Tensor) -> int:
        """The axis of ``chunk_shape`` that grows with the number of tokens (tokens, or blocks)."""
        n = self.block_size(cache)
        one, two = self.chunk_shape(cache, n), self.chunk_shape(cache, 2 * n)
        return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)

    def gather_chunks(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        """``gather`` of ``k = out.shape[0]`` chunks of ``n = len(slots) // k`` tokens into ``out``
        (contiguous, ``[k, *chunk_shape(n)]``): ``out[i]`` gets the KV of ``slots[i*n:(i+1)*n]``.
        The default gathers into a temporary of ``chunk_shape(k*n)`` and rearranges it."""
        k, axis, shape = out.shape[0], self.token_axis(cache), self.chunk_shape(cache, slots.numel())
        if axis == 0 or k == 1:  # out is that shape already, in that order
            self.gather(cache, slots, out.view(shape))
            return
        merged = torch.empty(shape, dtype=out.dtype, device=out.device)
        self.gather(cache, slots, merged)
        out.copy_(merged.view(*merged.shape[:axis], k, -1, *merged.shape[axis + 1:]).movedim(axis, 0))

    def scatter_chunks(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """The inverse of ``gather_chunks``: ``src[i]`` (``[k, *chunk_shape(n)]``) into the cache at
        ``slots[i*n:(i+1)*n]``. The default rearranges ``src`` (a copy unless ``k`` is 1 or the
        token axis leads) and scatters it."""
        axis = self.token_axis(cache)
        merged = src.movedim(0, axis).reshape(self.chunk_shape(cache, slots.numel()))
        self.scatter(cache, slots, merged)

    def host_layer(self, cache: torch.Tensor) -> HostLayer | None:
        """``cache`` (on the CPU) as numpy items for ``kernels.host_copy``, in ``chunk_shape`` order;
        None where only ``gather``/``scatter`` can copy it."""
        return None

    def num_heads(self, cache: torch.Tensor) -> int:
        """KV heads ``cache`` holds (1 for a layout not cut by head)."""
        return 1 if self.head_axes is None else int(cache.shape[self.head_axes[0]])

    def record_shape(self, cache: torch.Tensor, num_tokens: int, heads: int) -> tuple[int, ...]:
        """``chunk_shape`` of a record holding ``heads`` KV heads (``cache`` may hold others)."""
        shape = list(self.chunk_shape(cache, num_tokens))
        if self.head_axes is not None:
            shape[self.head_axes[1]] = heads
        elif heads != 1:
            raise ValueError(f"{self.name} is not cut by KV head; a record of {heads} heads cannot be one of it")
        return tuple(shape)

    def narrow_heads(self, t: torch.Tensor, start: int, count: int, *, staging: bool = False,
                     lead: int = 0) -> torch.Tensor:
        """The view of heads ``[start, start + count)`` of a cache (or, ``staging``, of a staging
        tensor of ``chunk_shape`` order after ``lead`` leading axes): no copy."""
        if self.head_axes is None:
            raise ValueError(f"{self.name} is not cut by KV head")
        return t.narrow(lead + self.head_axes[1 if staging else 0], start, count)

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
        return try_view(b, (*lead, nslots, -1))

    def _pair(self, cache: torch.Tensor, staging: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = self._rows(cache)
        if rows is None:
            return None
        flat = staging.view(*rows.shape[:self._lead], n, -1)
        r64, f64 = as_int64(rows), as_int64(flat)
        if r64 is not None and f64 is not None:
            return r64, f64
        return rows, flat

    def host_layer(self, cache: torch.Tensor) -> HostLayer | None:
        if cache.device.type != "cpu" or self._lead > 1:  # host_copy walks at most one lead dim
            return None
        b = self._blocked(cache)
        lead = tuple(b.shape[:self._lead])
        blocks = try_view(b, (*lead, b.shape[self._lead], -1))
        rows = self._rows(cache)
        host = HostLayer(None if rows is None else np_items(rows),
                          None if blocks is None else np_items(blocks), b.shape[self._lead + 1])
        return host if host.tokens is not None or host.blocks is not None else None

    def _num_slots(self, cache: torch.Tensor) -> int:
        b = self._blocked(cache)
        return int(b.shape[self._lead] * b.shape[self._lead + 1])

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        _check_range(slots, self._num_slots(cache), "slot")
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
        _check_range(slots, self._num_slots(cache), "slot")
        pair = self._pair(cache, src, slots.numel())
        if pair is not None:
            pair[0].index_copy_(self._lead, slots, pair[1])
        else:
            b = self._blocked(cache)
            bs = b.shape[self._lead + 1]
            idx = (slice(None),) * self._lead + (slots // bs, slots % bs)
            b[idx] = src

    def _chunk_rows(self, cache: torch.Tensor, staging: torch.Tensor,
                    n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache's rows ``[*lead, num_slots, R]`` and a view ``[*lead, k, n, R]`` of a
        ``[k, *chunk_shape(n)]`` staging (int64 where both allow), or None where the cache's
        strides do not merge."""
        rows = self._rows(cache)
        if rows is None:
            return None
        k, lead = staging.shape[0], tuple(rows.shape[:self._lead])
        view = staging.view(k, *lead, n, rows.shape[-1]).movedim(0, self._lead)
        r64, v64 = as_int64(rows), as_int64(view)
        return (r64, v64) if r64 is not None and v64 is not None else (rows, view)

    def gather_chunks(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        k = out.shape[0]
        pair = self._chunk_rows(cache, out, slots.numel() // k) if k > 1 else None
        if pair is None:
            super().gather_chunks(cache, slots, out)
            return
        _check_range(slots, self._num_slots(cache), "slot")
        rows, view = pair
        if self._lead == 0 and view.is_contiguous():  # [k*n, R] in slot order: one index_select, no temporary
            torch.index_select(rows, 0, slots, out=view.view(slots.numel(), -1))
        else:
            view.copy_(rows[(slice(None),) * self._lead + (slots.view(k, -1),)])

    def scatter_chunks(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        k = src.shape[0]
        pair = self._chunk_rows(cache, src, slots.numel() // k) if k > 1 else None
        if pair is None:
            super().scatter_chunks(cache, slots, src)
            return
        _check_range(slots, self._num_slots(cache), "slot")
        rows, view = pair
        # One indexed write per layer reading the staging where it lies (flash's K/V axis
        # strided across records): no rearranged copy first.
        rows[(slice(None),) * self._lead + (slots.view(k, -1),)] = view


class FlashLayout(_TokenLayout):
    """vLLM's legacy FlashAttention cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

    Staging: ``[2, n, num_kv_heads, head_size]`` (K then V).
    """

    name = "flash-2bnhd"
    _lead = 1
    head_axes = (3, 2)

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
    head_axes = (1, 1)

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
    head_axes = (1, 1)
    head_pages = True

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
        _check_range(ids, self.num_blocks(cache), "block")
        if slots.device.type == "cpu":  # cheap on host; on an accelerator it would force a sync
            expect = (ids[:, None] * bs + torch.arange(bs)).flatten()
            if not torch.equal(expect, slots):
                raise ValueError(f"{self.name} copies whole blocks: slots must cover whole blocks in order")
        return ids

    def _pages(self, cache: torch.Tensor, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = try_view(cache, (cache.shape[0], -1))
        if pages is None:
            return cache, staging
        flat = staging.view(staging.shape[0], -1)
        p64, f64 = as_int64(pages), as_int64(flat)
        return (p64, f64) if p64 is not None and f64 is not None else (pages, flat)

    def host_layer(self, cache: torch.Tensor) -> HostLayer | None:
        if cache.device.type != "cpu":
            return None
        pages = try_view(cache, (self.num_blocks(cache), -1))
        blocks = None if pages is None else np_items(pages)
        return None if blocks is None else HostLayer(None, blocks, self.block_size(cache))

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ids = self._block_ids(cache, slots)
        pages, flat = self._pages(cache, out)
        torch.index_select(pages, 0, ids, out=flat)
        return out

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        ids = self._block_ids(cache, slots)
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

