"""Deterministic seeded weights at a realistic scale.

Each tensor is drawn from its own generator seeded by ``(config.seed, tensor name)``, so weights
do not depend on creation order or on which pipeline stage builds them. Projections are normal
with ``config.init_std`` (0.05-0.1), embeddings normal with std 1, norms ones: outputs depend on
every KV value, unlike near-zero "dummy" weights.
"""

from __future__ import annotations

import hashlib

import torch

from kvstore.reference.config import EngineConfig


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def init_weight(config: EngineConfig, name: str, shape: tuple[int, ...], std: float | None = None) -> torch.Tensor:
    """The weight ``name`` of ``shape``: ``N(0, std)`` (``init_std`` by default), in the config dtype."""
    w = torch.empty(shape, dtype=torch.float32)
    w.normal_(0.0, config.init_std if std is None else std, generator=_generator(config.seed, name))
    return w.to(device=config.device, dtype=getattr(torch, config.dtype))
