"""Paged KV caches: layouts (``layouts``), CPU copy kernels (``kernels``), torch helpers
(``tensors``), ``KVTransfer`` (``transfer``), the engine-agnostic core that moves a sequence's
KV between a paged cache and a store through leased pool buffers (``kvstore.buffers``), and
``StateTransfer`` (``state``), which does the same for the recurrent state a prefix ends with."""

from kvstore.paged.layouts import (
    LAYOUTS,
    BHNCLayout,
    CPUPackedLayout,
    FlashLayout,
    MLALayout,
    PagedLayout,
    get_layout,
)
from kvstore.paged.state import StateTransfer
from kvstore.paged.tensors import dtype_name, slots_from_block_table
from kvstore.paged.transfer import KVTransfer

__all__ = ["PagedLayout", "FlashLayout", "BHNCLayout", "CPUPackedLayout", "MLALayout", "LAYOUTS", "get_layout",
           "dtype_name", "KVTransfer", "StateTransfer", "slots_from_block_table"]
