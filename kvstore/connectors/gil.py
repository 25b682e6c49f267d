"""The interpreter's thread switch interval, which an adapter lowers at start-up (``switch_interval``).

kvstore's loads and saves run on Python threads beside the engine's own. Each of their system
calls (a ``recv_into``, a ``send``, a hash of a slice) releases the GIL and must take it back
afterwards; while the engine's thread runs Python, that takes up to ``sys.getswitchinterval()``
(CPython's default: 5 ms) per call, which makes transfers beside a busy engine thread many
times slower (figures: ``benchmarks/results/gil.md``). A shorter interval bounds each wait; the
engine's thread then hands the GIL over more often, but only while a transfer waits for it.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["DEFAULT_SWITCH_INTERVAL", "lower_switch_interval"]

log = logging.getLogger(__name__)

#: What the adapters' ``switch_interval`` option lowers the interval to by default (seconds).
DEFAULT_SWITCH_INTERVAL = 0.0005


def lower_switch_interval(seconds: float, *, who: str = "kvstore") -> bool:
    """Set the interpreter's switch interval to ``seconds`` if it is longer now (never longer:
    an engine that chose a shorter one keeps it); 0 leaves it as it is. True if it changed."""
    current = sys.getswitchinterval()
    if seconds <= 0 or current <= seconds:
        return False
    sys.setswitchinterval(seconds)
    log.info("%s: Python's thread switch interval lowered from %g ms to %g ms (switch_interval), so that "
             "background loads and saves do not wait behind the engine's thread", who, current * 1e3, seconds * 1e3)
    return True
