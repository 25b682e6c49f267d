"""Configuration of the reference engine: model shape, seed, dtype and paged-cache geometry."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvstore.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """Shape and seed of the reference model plus its KV-cache geometry.

    ``fingerprint`` hashes every field that changes weights or KV bytes, so two engines share
    cached KV only if they would compute the same KV.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    init_std: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 256
    kv_layout: str = "flash-2bnhd"
    #: Where weights and the KV cache live (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r}; accepted: float32, bfloat16, float16")
        from kvstore.reference.kvcache import ENGINE_LAYOUTS

        if self.kv_layout not in ENGINE_LAYOUTS:
            raise ConfigError(f"kv_layout={self.kv_layout!r}; accepted: {', '.join(ENGINE_LAYOUTS)}")

    @property
    def name(self) -> str:
        return "kvstore-reference-llama"

    @property
    def fingerprint(self) -> str:
        """Hash of what determines the weights (not the cache geometry, which the namespace carries)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("num_blocks", "block_size", "kv_layout")}
        if self.device == "cpu":  # fingerprints from before devices existed stay valid
            del fields["device"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)

    def num_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h


#: Named sizes: ``tiny`` for tests (milliseconds), ``small`` for the demo, ``bench`` for TTFT
#: benchmarks (about 230 MB of fp32 weights; prefill dominates time-to-first-token).
PRESETS: dict[str, EngineConfig] = {
    "tiny": EngineConfig(),
    "small": EngineConfig(vocab_size=4096, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                          head_dim=64, intermediate_size=1536, init_std=0.05, block_size=16, num_blocks=512),
    "bench": EngineConfig(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                          head_dim=64, intermediate_size=1536, init_std=0.05, block_size=16, num_blocks=512),
}
