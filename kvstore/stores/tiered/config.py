"""Options of the tiered store: write queues, the circuit breaker, promotion, shutdown.

The write queues' byte limit scales with the memory this process may use: unless
``queue_bytes`` is set, each shared tier's queue holds at most 1/16 of it (``available_memory``:
physical RAM, or the cgroup's memory limit inside a container when that is lower), so a tier
that stops answering costs a bounded, machine-relative amount of RAM before writes are dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.config import MAX_DURATION, check_range, option
from kvstore.errors import ConfigError

__all__ = ["TieredConfig", "available_memory", "QUEUE_MEMORY_FRACTION"]

#: The share of ``available_memory()`` one shared tier's write queue holds by default.
QUEUE_MEMORY_FRACTION = 16
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def available_memory() -> int:
    """Bytes of memory this process may use: physical RAM, or a lower cgroup (container) limit."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30  # a platform that does not say: assume a small machine
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:  # "max" (or a huge v1 number) means none
            total = int(text)
    return total


@dataclass(frozen=True)
class TieredConfig:
    queue_items: int = option(1024, help="Writes a shared tier's queue holds before new ones are dropped (1 to 1000000).")
    queue_bytes: int = option(
        0, kind="size", help="Bytes a shared tier's queue holds before new writes are dropped; 0 (default): 1/16 of "
        "the memory this process may use (physical RAM or the container's limit). At most that memory.")
    batch_bytes: int = option(128 << 20, kind="size", help="Bytes a background writer sends in one batch (at most 4GiB).")
    breaker_failures: int = option(3, help="Consecutive failures that take a tier out of use (1 to 1000); one "
                                           "expired deadline does at once.")
    breaker_cooldown: float = option(2.0, kind="duration", help="How long a failed tier is skipped before a "
                                     "background probe (1ms to 1h).")
    breaker_max_cooldown: float = option(30.0, kind="duration", help="Longest skip after repeated failed probes "
                                         "(at most 1d; below breaker_cooldown it is breaker_cooldown).")
    promote: bool = option(True, help="Copy hits from lower tiers into the tiers above.")
    close_timeout: float = option(10.0, kind="duration", help="How long close() waits for queued writes (at most 1h).")

    def __post_init__(self) -> None:
        memory = available_memory()
        check_range("queue_items", self.queue_items, 1, 1_000_000)
        check_range("queue_bytes", self.queue_bytes, 0, memory, unit=" bytes (0: automatic)")
        check_range("batch_bytes", self.batch_bytes, 1, 4 << 30, unit=" bytes")
        check_range("breaker_failures", self.breaker_failures, 1, 1000)
        check_range("breaker_cooldown", self.breaker_cooldown, 1e-3, 3600.0, unit="s")
        check_range("breaker_max_cooldown", self.breaker_max_cooldown, 1e-3, 86400.0, unit="s")
        check_range("close_timeout", self.close_timeout, 0.0, min(3600.0, MAX_DURATION), unit="s")
        if self.queue_bytes == 0:
            object.__setattr__(self, "queue_bytes", max(1, memory // QUEUE_MEMORY_FRACTION))
        if type(self.promote) is not bool:
            raise ConfigError(f"promote={self.promote!r} must be true or false")
