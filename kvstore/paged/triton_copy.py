"""Every layer's copy of a window of records in one kernel launch: a Triton kernel over a table of
the layers' base pointers, the candidate to replace the device path's per-layer launches (32 per
load of a 32-layer model, 64 per save of the flash layout: about 1.2 and 2 ms of host time, for
0.4 ms of device work, on an H200).

Optional, and not the default: this module imports Triton (absent from CPU installs: vLLM CPU's
set-up removes it), so only a caller that asked for the kernel imports it, and the torch path
(``PagedLayout.scatter_chunks`` / ``gather_chunks``, one launch per layer) stays the fallback.
``available(device)`` says whether it can run: Triton importable, and a CUDA device or Triton's
interpreter (``TRITON_INTERPRET=1``, which the tests use on the CPU).

Contract, the torch path's: ``LayerScatter(caches, layout)(slots, records)`` writes
``records[i, layer]`` (``records``: ``[k, layers, *chunk_shape(n)]``, contiguous) into every
layer's cache at ``slots[i*n:(i+1)*n]``; ``LayerGather(caches, layout)(slots, records)`` reads
them back into ``records``. Token layouts whose caches' rows merge into one dimension (flash,
vllm-bhnc, mla; all layers with one geometry) only: ``supports(caches, layout)`` says. Slots are
not checked on the device (an out-of-range slot writes out of bounds): ``KVTransfer`` checks
host slots before any copy, as it does for the torch path's device-side assert.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (a Triton kernel's parameters take no Python annotations: Triton reads them as its own types)
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from kvstore.paged.layouts import PagedLayout

__all__ = ["available", "supports", "LayerScatter", "LayerGather"]

_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _copy_rows(table, slots, staging, n_tok, n_layers, n_lead, lead_stride, slot_stride, row,
               TO_CACHE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token of the window, layer x lead index): one row of ``row`` elements
    between the layer's cache (its base pointer from ``table``) and the staged records."""
    tok = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a cache of many blocks outgrows 32 bits
    pair = tl.program_id(1).to(tl.int64)
    layer = pair // n_lead
    lead = pair % n_lead
    rec = tok // n_tok
    t = tok % n_tok
    slot = tl.load(slots + tok)
    base = tl.load(table + layer).to(staging.dtype)
    cache_row = base + lead * lead_stride + slot * slot_stride
    staged_row = staging + (((rec * n_layers + layer) * n_lead + lead) * n_tok + t) * row
    for start in range(0, row, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < row
        if TO_CACHE:
            tl.store(cache_row + cols, tl.load(staged_row + cols, mask=mask), mask=mask)
        else:
            tl.store(staged_row + cols, tl.load(cache_row + cols, mask=mask), mask=mask)


def available(device: torch.device) -> bool:
    """Whether the kernel runs for caches on ``device`` (CUDA, or Triton's interpreter on the CPU)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _rows(cache: torch.Tensor, layout: PagedLayout) -> torch.Tensor | None:
    rows = getattr(layout, "_rows", None)
    return None if rows is None else rows(cache)


def supports(caches: Sequence[torch.Tensor], layout: PagedLayout) -> bool:
    """Whether the kernel copies these caches: a token layout whose rows merge, every layer alike."""
    return _Geometry.of(caches, layout) is not None


class _Geometry:
    """The caches' rows as elements of the widest integer type their row, strides and addresses
    allow: a lead dimension (flash's K/V, or none), a slot stride, a row length."""

    def __init__(self, dtype: torch.dtype, width: int, n_lead: int, lead_stride: int, slot_stride: int,
                 row: int) -> None:
        self.dtype, self.width = dtype, width
        self.n_lead, self.lead_stride, self.slot_stride, self.row = n_lead, lead_stride, slot_stride, row

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], layout: PagedLayout) -> _Geometry | None:
        if not caches or layout.granularity != "token":
            return None
        views = [_rows(c, layout) for c in caches]
        first = views[0]
        if first is None or first.dim() not in (2, 3) or first.stride(-1) != 1:
            return None
        if any(v is None or v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
               for v in views):
            return None
        item = first.element_size()
        row_bytes = first.shape[-1] * item
        strides = [s * item for s in first.stride()[:-1]]
        for width, dtype in _WIDTHS:
            if row_bytes % width == 0 and all(s % width == 0 for s in strides) and \
                    all(v.data_ptr() % width == 0 for v in views if v is not None):
                lead = first.dim() == 3
                return cls(dtype, width, first.shape[0] if lead else 1, strides[0] // width if lead else 0,
                           strides[-1] // width, row_bytes // width)
        return None  # pragma: no cover - width 1 always fits


class _LayerCopy:
    def __init__(self, caches: Sequence[torch.Tensor], layout: PagedLayout) -> None:
        geometry = _Geometry.of(caches, layout)
        if geometry is None:
            raise ValueError(f"the Triton copy does not take these caches ({layout.name}); use the torch path")
        self.geometry = geometry
        self.caches = list(caches)  # their memory must live as long as the table of their addresses
        views = [_rows(c, layout) for c in caches]
        self.table = torch.tensor([v.data_ptr() for v in views if v is not None], dtype=torch.int64,
                                  device=caches[0].device)
        self.block = min(1024, triton.next_power_of_2(geometry.row))

    def _launch(self, slots: torch.Tensor, records: torch.Tensor, to_cache: bool) -> None:
        g = self.geometry
        k = records.shape[0]
        if not records.is_contiguous() or records.shape[1] != len(self.caches) or slots.numel() % k:
            raise ValueError(f"records {list(records.shape)} for {slots.numel()} slots and {len(self.caches)} layers")
        n = slots.numel() // k
        staging = records.view(-1).view(torch.uint8).view(g.dtype)
        if staging.numel() != k * len(self.caches) * g.n_lead * n * g.row:
            raise ValueError(f"records of {staging.numel() * g.width} bytes do not hold {k} x {n} tokens")
        grid = (k * n, len(self.caches) * g.n_lead)
        _copy_rows[grid](self.table, slots, staging, n, len(self.caches), g.n_lead, g.lead_stride, g.slot_stride,
                         g.row, TO_CACHE=to_cache, BLOCK=self.block)


class LayerScatter(_LayerCopy):
    """``records`` into every layer's cache at ``slots``, one launch (module docstring)."""

    def __call__(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        self._launch(slots, records, True)


class LayerGather(_LayerCopy):
    """Every layer's KV at ``slots`` into ``records``, one launch (module docstring)."""

    def __call__(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        self._launch(slots, records, False)


def describe() -> dict[str, Any]:
    """Triton's version, for a benchmark's header."""
    return {"triton": triton.__version__}
