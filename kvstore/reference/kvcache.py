"""How the reference engine reads and writes its own paged KV cache, per layout.

The engine supports three of ``kvstore.paged``'s layouts, so end-to-end tests cover each:

* ``flash-2bnhd``: ``[2, num_blocks, block_size, kv_heads, head_dim]``;
* ``vllm-bhnc``: vLLM 0.32's logical view ``[num_blocks, kv_heads, block_size, 2*head_dim]``,
  allocated physically ``[B][N][H][2D]`` and permuted (non-contiguous, as on GPUs);
* ``vllm-cpu-vec``: the same view with pages packed like vLLM's CPU ``vec`` kernel (K
  transposed: ``K[n, d]`` at ``d*N + n`` of the head's page, V row-major after it), so the
  page contents are not token-addressable and transfers must copy whole blocks.
"""

from __future__ import annotations

import torch


def _bhnc_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tok = cache.transpose(1, 2)  # [B, N, H, 2D]
    d = tok.shape[-1] // 2
    return tok[..., :d], tok[..., d:]


def _cpu_pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, c = cache.shape
    d = c // 2
    page = cache.reshape(b, h, n * c)  # contiguous: a view
    k = page[..., :n * d].view(b, h, d, n).permute(0, 3, 1, 2)  # [B, N, H, D] view of K^T storage
    v = page[..., n * d:].view(b, h, n, d).transpose(1, 2)       # [B, N, H, D]
    return k, v


class EngineKV:
    """Allocate, write and read one layer's paged cache in ``layout``."""

    def __init__(self, layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str = "cpu") -> None:
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device

    def allocate(self) -> torch.Tensor:
        b, n, h, d = self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        dtype, device = self.dtype, self.device
        if self.layout == "flash-2bnhd":
            return torch.zeros(2, b, n, h, d, dtype=dtype, device=device)
        if self.layout == "vllm-bhnc":
            return torch.zeros(b, n, h, 2 * d, dtype=dtype, device=device).permute(0, 2, 1, 3)
        return torch.zeros(b, h, n, 2 * d, dtype=dtype, device=device)

    def _kv(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[B, N, H, D]`` views of ``cache``."""
        if self.layout == "flash-2bnhd":
            return cache[0], cache[1]
        if self.layout == "vllm-bhnc":
            return _bhnc_kv(cache)
        return _cpu_pages(cache)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, H, D]`` at token ``slots``."""
        kc, vc = self._kv(cache)
        slots = slots.to(cache.device)
        blk, off = slots // self.block_size, slots % self.block_size
        kc[blk, off] = k
        vc[blk, off] = v

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, H, D]`` of a sequence whose blocks are ``block_ids``."""
        kc, vc = self._kv(cache)
        nb = -(-num_tokens // self.block_size)
        ids = block_ids[:nb].to(cache.device)
        shape = (nb * self.block_size, self.kv_heads, self.head_dim)
        return kc[ids].reshape(shape)[:num_tokens], vc[ids].reshape(shape)[:num_tokens]


ENGINE_LAYOUTS = ("flash-2bnhd", "vllm-bhnc", "vllm-cpu-vec")
