"""Options of the tiered store: write queues, the circuit breaker, promotion, shutdown."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config import option
from kvstore.errors import ConfigError

__all__ = ["TieredConfig"]


@dataclass(frozen=True)
class TieredConfig:
    queue_items: int = option(1024, help="Writes a shared tier's queue holds before new ones are dropped.")
    queue_bytes: int = option(2 << 30, kind="size", help="Bytes a shared tier's queue holds before new writes are dropped.")
    batch_bytes: int = option(128 << 20, kind="size", help="Bytes a background writer sends in one batch.")
    breaker_failures: int = option(3, help="Consecutive failures that take a tier out of use.")
    breaker_cooldown: float = option(2.0, kind="duration", help="How long a failed tier is skipped before a probe.")
    breaker_max_cooldown: float = option(30.0, kind="duration", help="Longest skip after repeated failed probes.")
    promote: bool = option(True, help="Copy hits from lower tiers into the tiers above.")
    close_timeout: float = option(10.0, kind="duration", help="How long close() waits for queued writes.")

    def __post_init__(self) -> None:
        for name in ("queue_items", "batch_bytes", "breaker_failures"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
