"""How fast a tier answers, measured online: round-trip latency and read bandwidth (EWMAs).

Every guarded call of a tier feeds its tier's ``LinkSpeed``: small calls (lookups) give the
latency of one round trip, reads of whole values give bytes over time beyond that latency. A
load-or-recompute decision (``kvstore.cost``) reads them; they are also published as gauges.
"""

from __future__ import annotations

import threading

from kvstore.metrics.catalog import TIER_BANDWIDTH, TIER_LATENCY

__all__ = ["LinkSpeed"]

_ALPHA = 0.2  # weight of the newest sample: about the last ten calls matter
_MIN_READ_BYTES = 1 << 20  # reads smaller than this say more about latency than bandwidth


class LinkSpeed:
    """Latency (seconds per round trip) and bandwidth (bytes per second) of one tier; None until measured."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.latency: float | None = None
        self.bandwidth: float | None = None

    def round_trip(self, seconds: float) -> None:
        """A call that moved (almost) no data took ``seconds``."""
        with self._lock:
            self.latency = seconds if self.latency is None else (1 - _ALPHA) * self.latency + _ALPHA * seconds
            TIER_LATENCY.set(self.latency, tier=self.tier)

    def read(self, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` took ``seconds`` (one round trip included)."""
        if nbytes < _MIN_READ_BYTES:
            return
        with self._lock:
            transfer = max(seconds - (self.latency or 0.0), seconds / 2, 1e-9)
            rate = nbytes / transfer
            self.bandwidth = rate if self.bandwidth is None else (1 - _ALPHA) * self.bandwidth + _ALPHA * rate
            TIER_BANDWIDTH.set(self.bandwidth, tier=self.tier)

    def seconds_for(self, nbytes: int) -> float | None:
        """Estimated time to read ``nbytes`` in one batch; None while the tier is unmeasured."""
        with self._lock:
            if self.bandwidth is None:
                return None
            return (self.latency or 0.0) + nbytes / self.bandwidth
