"""Copy kernels for CPU caches: numpy item copies, all layers with one index computation.

A layer's cache is viewed as numpy arrays of opaque *items* sharing its memory: one token's row
or, when the slots of a chunk are whole blocks in order (a 256-token chunk at block size 16 is
16 blocks), one whole block. numpy moves each item with one ``memcpy``, at any alignment, on
the calling thread, and never waits on torch's intra-op pool (which stalls when the cores are
shared). ``KVTransfer`` uses these on the CPU and the layouts' torch copies everywhere else
(figures: ``benchmarks/results/paged.md``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["HostLayer", "BlockBytes", "np_items", "host_bytes", "host_copy", "host_layers"]


class HostLayer(NamedTuple):
    """One CPU layer's cache as numpy arrays of opaque items, sharing its memory: ``tokens``
    ``[*lead, num_slots]`` (one token's row each) and ``blocks`` ``[*lead, num_blocks]`` (one
    whole block each); either is None where the layout or the strides do not allow it."""

    tokens: np.ndarray | None
    blocks: np.ndarray | None
    block_size: int


def np_items(t: torch.Tensor | np.ndarray) -> np.ndarray | None:
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


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
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
    first: np.ndarray = starts[:, 0]
    if (first % block_size).any() or not (starts == first[:, None]).all():
        return None
    return first // block_size


def host_copy(layers: Sequence[HostLayer], slots: torch.Tensor, staging: np.ndarray, to_cache: bool,
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
    staged_items = np_items(staging.reshape(shape))
    assert staged_items is not None  # staging is flat bytes: its reshape's last axis is contiguous
    staged = staged_items[..., skip_items:]
    for layer, part in zip(layers, staged):
        cache_items = getattr(layer, kind)
        pairs = zip(cache_items, part) if cache_items.ndim == 2 else ((cache_items, part),)
        for c, st in pairs:
            if to_cache:
                c[idx] = st
            else:  # mode="raise" would buffer the whole output; the range is checked above
                np.take(c, idx, out=st, mode="clip")
    return True


def host_layers(layers: Sequence[HostLayer | None]) -> list[HostLayer] | None:
    """Every layer's item views (``PagedLayout.host_layer`` of each cache), keeping only the
    kinds that all layers have; None if a layer has none or no kind is common to all."""
    if not layers or any(h is None for h in layers):
        return None
    views = [h for h in layers if h is not None]
    tokens = all(h.tokens is not None for h in views)
    blocks = all(h.blocks is not None for h in views)
    if not (tokens or blocks):
        return None
    return [h._replace(tokens=h.tokens if tokens else None, blocks=h.blocks if blocks else None) for h in views]


class BlockBytes:
    """Every layer's whole blocks as writable byte memoryviews, for landing records straight in
    the cache and sending records from it (``targets``); built once per set of layers."""

    def __init__(self, layers: Sequence[HostLayer]) -> None:
        self.block_size = layers[0].block_size if layers else 0
        rows: list[memoryview] = []
        item = 0
        for layer in layers:
            blocks = layer.blocks
            if blocks is None or blocks.strides[-1] != blocks.dtype.itemsize or not blocks.flags.writeable:
                rows = []
                break
            item = blocks.dtype.itemsize
            flat = blocks.view(np.uint8)  # [*lead, num_blocks * item]: one run of blocks per lead index
            rows.extend(memoryview(r) for r in (flat if flat.ndim == 2 else flat[None]))
        #: Per layer and lead index (K/V), in ``host_copy``'s staging order: the row of its blocks' bytes.
        self.rows = rows
        self.item = item

    def targets(self, slots: torch.Tensor) -> list[memoryview] | None:
        """The cache bytes of ``slots`` (whole blocks, in order) as a chunk's record holds them
        (``host_copy``'s staging order: layer, lead index, block), runs of consecutive blocks as
        one buffer each; None where ``slots`` are not whole blocks or the cache not viewable so."""
        if not self.rows or slots.device.type != "cpu":
            return None
        ids = _whole_blocks(slots.numpy(), self.block_size)
        if ids is None:
            return None
        size = len(self.rows[0]) // self.item
        if ids.min() < 0 or ids.max() >= size:
            return None
        return self._runs(ids)

    def part_targets(self, slots: torch.Tensor, heads: int, record_heads: int, src_at: int, dst_at: int,
                     count: int, scratch: memoryview) -> list[memoryview] | None:
        """Where a record of ``record_heads`` KV heads per block lands in a cache of ``heads`` heads
        per block (vLLM CPU's pages: each block a run of head pages), in record order: per layer
        and block, its heads ``[src_at, src_at + count)`` into the cache's heads ``[dst_at, ...)``
        and every other head into ``scratch`` (each piece a region of its own, so bytes received in
        one call never overwrite each other before they are hashed), which must hold them all.
        None where ``slots`` are not whole blocks or the cache not viewable so."""
        if not self.rows or slots.device.type != "cpu" or self.item % heads:
            return None
        ids = _whole_blocks(slots.numpy(), self.block_size)
        size = len(self.rows[0]) // self.item if self.rows else 0
        if ids is None or ids.min() < 0 or ids.max() >= size:
            return None
        page = self.item // heads
        before, after = src_at * page, (record_heads - src_at - count) * page
        if len(scratch) < (before + after) * len(ids) * len(self.rows):
            return None
        out: list[memoryview] = []
        at = 0
        for row in self.rows:
            for block in ids.tolist():
                if before:
                    out.append(scratch[at:at + before])
                    at += before
                start = block * self.item + dst_at * page
                out.append(row[start:start + count * page])
                if after:
                    out.append(scratch[at:at + after])
                    at += after
        return out

    def _runs(self, ids: np.ndarray) -> list[memoryview]:
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [ids.size]))
        item = self.item
        runs = [(int(ids[a]) * item, (int(ids[b - 1]) + 1) * item) for a, b in zip(starts, ends)]
        return [row[lo:hi] for row in self.rows for lo, hi in runs]
