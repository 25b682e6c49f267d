"""A circuit breaker: skip a tier that keeps failing, probe it again after a cooldown.

States: ``closed`` (calls go through), ``open`` (calls are skipped until the cooldown ends),
``half_open`` (exactly one caller gets to probe; its success closes the breaker, its failure
opens it again for a longer cooldown, doubling up to ``max_cooldown``). ``failures``
consecutive failures open a closed breaker, and so does one failure reported with
``trip=True`` (an expired deadline: a server that froze will not answer the next caller
either); any success resets the count.

With ``background_probe=True`` no ordinary caller ever probes: ``allow()`` is true only while
closed, and the owner's prober thread asks ``probe_due()`` and makes the probe itself, so an
engine thread never pays for a probe of a tier that is still down.

Each state change is logged once (a warning when the tier is given up, info when it is back,
debug for probes in between) and published in the ``kvstore_tier_state`` gauge
(0 closed, 1 half-open, 2 open), so an outage costs one log line, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.metrics.catalog import TIER_STATE, TIER_TRIPS

__all__ = ["CircuitBreaker", "CLOSED", "HALF_OPEN", "OPEN"]

log = logging.getLogger("kvstore.stores")

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
_STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    """Thread-safe breaker for one tier. Callers ask ``allow()`` and then report the outcome."""

    def __init__(self, name: str, *, failures: int = 3, cooldown: float = 2.0, max_cooldown: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, background_probe: bool = False) -> None:
        if failures < 1:
            raise ValueError(f"failures={failures} must be at least 1")
        self.name = name
        self.failures = failures
        self.cooldown = cooldown
        self.max_cooldown = max(max_cooldown, cooldown)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0
        self._current_cooldown = cooldown
        self._reopen_at = 0.0
        self._probe_deadline = 0.0
        self.last_error = ""
        self.background_probe = background_probe
        TIER_STATE.set(0, tier=name)

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """True if the caller may use the tier now (in half-open state: only the one prober)."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self.background_probe:
                return False
            return self._take_probe()

    def probe_due(self) -> bool:
        """For the owner's prober: True (and the breaker half-open) when a probe should run now."""
        with self._lock:
            return self._state != CLOSED and self._take_probe()

    def seconds_to_probe(self) -> float:
        """How long until a probe is due (0 when due or closed), by the breaker's clock."""
        with self._lock:
            if self._state == CLOSED:
                return 0.0
            due = self._reopen_at if self._state == OPEN else self._probe_deadline
            return max(0.0, due - self._clock())

    def _take_probe(self) -> bool:
        """Under the lock: start a half-open probe if one is due."""
        now = self._clock()
        if self._state == OPEN and now >= self._reopen_at:
            self._set(HALF_OPEN, f"probing after {self._current_cooldown:g}s")
            self._probe_deadline = now + self._current_cooldown
            return True
        if self._state == HALF_OPEN and now >= self._probe_deadline:
            # The prober never reported (its thread died): let another caller probe.
            self._probe_deadline = now + self._current_cooldown
            return True
        return False

    def would_allow(self) -> bool:
        """Whether ``allow()`` might say yes now, without taking the half-open probe."""
        with self._lock:
            if self._state == CLOSED:
                return True
            return not self.background_probe and (
                (self._state == OPEN and self._clock() >= self._reopen_at)
                or (self._state == HALF_OPEN and self._clock() >= self._probe_deadline))

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            if self._state != CLOSED:
                self._current_cooldown = self.cooldown
                self._set(CLOSED, "tier is back")

    def failure(self, error: BaseException | str = "", *, trip: bool = False) -> None:
        """Report a failed call; ``trip`` opens a closed breaker at once (a deadline expired)."""
        with self._lock:
            self.last_error = str(error)[:300]
            self._consecutive += 1
            if self._state == HALF_OPEN:
                self._current_cooldown = min(self._current_cooldown * 2, self.max_cooldown)
                self._open(f"probe failed: {self.last_error}")
            elif self._state == CLOSED and (trip or self._consecutive >= self.failures):
                why = "deadline expired" if trip else f"{self._consecutive} consecutive failures"
                self._open(f"{why}, last: {self.last_error}")

    def _open(self, why: str) -> None:
        self._reopen_at = self._clock() + self._current_cooldown
        TIER_TRIPS.inc(tier=self.name)
        self._set(OPEN, f"{why}; skipped for {self._current_cooldown:g}s")

    def _set(self, state: str, why: str) -> None:
        if state == self._state:
            return
        previous, self._state = self._state, state
        TIER_STATE.set(_STATE_VALUE[state], tier=self.name)
        # An outage logs twice: a warning when the tier is given up, info when it is back.
        # Probes while it stays down (open <-> half-open) are debug-level only.
        if state == CLOSED:
            level = logging.INFO
        elif state == OPEN and previous == CLOSED:
            level = logging.WARNING
        else:
            level = logging.DEBUG
        log.log(level, "kvstore tier %s: %s (%s)", self.name, state.replace("_", "-"), why)
