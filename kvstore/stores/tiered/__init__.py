"""The tiered store (``store``) and its parts: per-tier circuit breakers (``breaker``), background
writers (``writer``), one tier's guarded calls (``tier``) and options (``config``)."""

from kvstore.stores.tiered.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvstore.stores.tiered.config import TieredConfig
from kvstore.stores.tiered.store import TieredStore

__all__ = ["TieredStore", "TieredConfig", "CircuitBreaker", "CLOSED", "HALF_OPEN", "OPEN"]
