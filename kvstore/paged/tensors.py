"""Small torch helpers shared by the layouts and the transfer: dtype names, block-table slots,
views that never copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvstore.keys import ChunkKey
from kvstore.types import Buffer, array_view

__all__ = ["dtype_name", "slots_from_block_table", "try_view", "as_int64", "tensor_bytes", "HiddenOf"]

#: The hidden state a chunk's record carries (its last token's): ``(bytes, dtype name, shape)``, or Nones.
HiddenOf = Callable[[ChunkKey], tuple[Buffer | None, str | None, tuple[int, ...] | None]]


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


def try_view(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor | None:
    try:
        return t.view(*shape)
    except RuntimeError:  # strides cannot be merged without a copy
        return None


def as_int64(t: torch.Tensor) -> torch.Tensor | None:
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



def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview (a copy only if ``t`` is not contiguous)."""
    return array_view(t.contiguous().view(-1).view(torch.uint8).numpy())
