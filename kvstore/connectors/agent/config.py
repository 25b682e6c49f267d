"""Options of the agent API (``KVStoreAgent``), on the same option machinery as the stores.

``AgentConfig(...)`` validates what it is given; ``AgentConfig.from_mapping(d)`` also converts
strings (``"256"``, ``"true"``, a comma-separated URL list) and rejects unknown keys by name, so
a V0-style ``kv_connector_extra_config`` can be passed as it is. Either way every value is held
to its declaration (``kvstore.config.check_options``): no control characters, numbers within
their range; the options both adapters offer (store, chunk_tokens, codec, authentication) are
defined once (``kvstore.connectors.options``, ``kvstore.record.auth``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import build, check_options, option, safe_repr
from kvstore.connectors.options import (
    chunk_tokens_option,
    codec_option,
    land_in_cache_option,
    store_option,
    switch_interval_option,
)
from kvstore.connectors.roles import ROLE_NAMES, Role, parse_role
from kvstore.errors import ConfigError
from kvstore.record.auth import key_env_option, key_file_option, previous_window_option
from kvstore.record.codecs import CHAINS
from kvstore.stores.tiered import TieredConfig

__all__ = ["AgentConfig"]

#: The names of ``kvstore.paged.LAYOUTS``, spelled out because that module imports torch and this
#: one must not (``kvstore.connectors.agent`` and the docs load it without torch); a test ties
#: the two (``tests/test_vocabulary.py``).
LAYOUT_NAMES = ("flash-2bnhd", "vllm-bhnc", "mla-bnl", "vllm-cpu-vec", "vllm-cpu-amx")
MAX_TP = 1 << 16  # tensor-parallel ranks: far beyond any deployment


@dataclass(frozen=True)
class AgentConfig:
    """What a ``KVStoreAgent`` needs; see the configuration reference for every field."""

    store: tuple[str, ...] = store_option()
    model: str = option("", help="Model name in the key namespace.")
    model_fingerprint: str = option(
        "", help="A revision or hash of the weights and config: KV is shared only between equal "
        "(model, model_fingerprint).")
    chunk_tokens: int = chunk_tokens_option()
    role: str = option("both", choices=ROLE_NAMES,
                       help="`both` loads and saves, `producer` only saves, `consumer` only loads.")
    rank: int = option(0, lo=0, hi=MAX_TP - 1,
                       help="Tensor-parallel rank whose KV shard this engine holds (part of the namespace).")
    tp_size: int = option(1, lo=1, hi=MAX_TP, help="Tensor-parallel size (part of the namespace).")
    local_rank: int = option(0, lo=0, hi=MAX_TP - 1, help="Accepted for vLLM V0 compatibility; not used by the agent.")
    codec: str = codec_option()
    switch_interval: float = switch_interval_option()
    land_in_cache: bool = land_in_cache_option()
    kv_layout: str = option(
        "", choices=("", *LAYOUT_NAMES),
        help="`kvstore.paged` layout of the KV cache; empty infers it for 5-d (`flash-2bnhd`) and 3-d "
        "(`mla-bnl`) caches; 4-d caches need it (`vllm-bhnc` or `vllm-cpu-vec`, which share a shape).")
    adapter: str = option("", help="Adapter (LoRA) id, part of the namespace.")
    cache_salt: str = option("", help="Tenant salt, part of the namespace: different salts never share records.")
    store_options: Mapping[str, Any] = option(
        factory=dict, help="Tiered store options (see [Tiered store](#tiered-store)).")
    auth_key_file: str = key_file_option()
    auth_key_env: str = key_env_option()
    auth_previous_window: float = previous_window_option()

    def __post_init__(self) -> None:
        store = self.store
        if isinstance(store, str):
            store = (store,)
        object.__setattr__(self, "store", tuple(store))
        missing = [n for n in ("store", "model", "model_fingerprint") if not getattr(self, n)]
        if missing:
            raise ConfigError(
                "the kvstore agent needs " + ", ".join(missing)
                + " (store: a URL or list of URLs such as 'file:///tmp/kv' or 'redis://host:6379'; "
                  "model and model_fingerprint: the model's name and a hash of its weights/config)")
        check_options(self)
        if not isinstance(self.store_options, Mapping):
            raise ConfigError(f"store_options={self.store_options!r} must be a mapping of tiered store options")
        try:
            build(TieredConfig, self.store_options, where="the tiered store")
        except ConfigError as exc:
            raise ConfigError(f"store_options: {exc}") from None
        object.__setattr__(self, "role", parse_role(self.role).name)
        for name in ("chunk_tokens", "tp_size", "rank", "local_rank"):
            if type(getattr(self, name)) is not int:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be an integer")
        if not 0 <= self.rank < self.tp_size:
            raise ConfigError(f"rank={self.rank!r} must be an integer in [0, tp_size={self.tp_size})")
        if self.kv_layout not in ("", *LAYOUT_NAMES):
            raise ConfigError(f"kv_layout={self.kv_layout!r}; accepted: {', '.join(LAYOUT_NAMES)}")
        if self.codec not in CHAINS:
            raise ConfigError(f"codec={self.codec!r}; accepted: {', '.join(CHAINS)}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> AgentConfig:
        """Build from a dict (raw strings or values), rejecting unknown keys by name."""
        return build(cls, options, where="the kvstore agent's options")

    def __repr__(self) -> str:  # store URLs may carry a password
        return safe_repr(self)

    @property
    def parsed_role(self) -> Role:
        return parse_role(self.role)
