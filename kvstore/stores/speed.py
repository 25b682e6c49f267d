"""How fast a tier answers, measured online: round-trip latency and read bandwidth (EWMAs).

Every guarded call of a tier feeds its tier's ``LinkSpeed``: small calls (lookups) give the
latency of one round trip, reads of whole values give bytes over time beyond that latency. A
load-or-recompute decision (``kvstore.cost``) reads them; they are also published as gauges.

A decision may be made in another process than the reads (vLLM's scheduler decides, its workers
read): ``take_reads`` hands over the reads measured since it was last called, as sums, for the
process that decides to learn from (``CostModel.observe_reads``).
"""

from __future__ import annotations

import threading

from kvstore.metrics.catalog import TIER_BANDWIDTH, TIER_LATENCY

__all__ = ["LinkSpeed", "transfer_rate"]

_ALPHA = 0.2  # weight of the newest sample: about the last ten calls matter
_MIN_READ_BYTES = 1 << 20  # reads smaller than this say more about latency than bandwidth


class LinkSpeed:
    """Latency (seconds per round trip) and bandwidth (bytes per second) of one tier; None until measured."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.latency: float | None = None
        self.bandwidth: float | None = None
        self._unreported = (0, 0.0, 0)  # bytes, seconds, reads not yet taken by take_reads

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
            rate = transfer_rate(nbytes, seconds, 1, self.latency)
            self.bandwidth = rate if self.bandwidth is None else (1 - _ALPHA) * self.bandwidth + _ALPHA * rate
            TIER_BANDWIDTH.set(self.bandwidth, tier=self.tier)
            b, s, n = self._unreported
            self._unreported = (b + nbytes, s + seconds, n + 1)

    def take_reads(self) -> tuple[int, float, int]:
        """``(bytes, seconds, reads)`` summed over the reads since the last call (zeros if none)."""
        with self._lock:
            out, self._unreported = self._unreported, (0, 0.0, 0)
            return out


def transfer_rate(nbytes: int, seconds: float, reads: int, latency: float | None) -> float:
    """Bytes per second of ``reads`` reads that moved ``nbytes`` in ``seconds`` in all, each read
    costing one round trip of ``latency`` beyond its bytes (at most half of the time is taken as
    latency: an overestimated latency must not make a link look infinitely fast)."""
    transfer = max(seconds - reads * (latency or 0.0), seconds / 2, 1e-9)
    return nbytes / transfer
