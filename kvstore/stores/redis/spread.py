"""How many connections per server a batch of writes, or of reads, spreads over, learned from
the batches before it (``RedisConfig.adapt_writes``, ``adapt_reads``; a store keeps one
``Spread`` for each).

More connections buy throughput only where something caps each one: a link that shapes every
flow, a path whose window a single flow cannot fill. Where nothing does (a loopback, one
server's core as the limit), each extra connection is an extra thread, more wakeups and more
system calls for the same bytes: CPU the engines on the host need. So batches start on one
connection (a write's sent from the caller's thread) and the width doubles only while doubling
it makes batches markedly faster.

The rule, on batches of at least ``MEASURED_BYTES`` and of at least as many values as the wider
neighbouring width has connections (a value goes whole over one connection, so a batch of fewer
cannot show what more connections buy; a smaller one says more about the round trip than about
the link). Other batches run at whatever width is current and teach nothing. A background
writer that keeps up sends a record or two per batch and so stays on one connection; once its
queue backs up, its batches grow and the width follows the link:

* The first measured batch at any width (the store's first, a probe's first at a new width)
  opens its connections and teaches nothing; a probe is then handed out again.
* Every so many measured batches, one is a probe at a neighbouring width: double the current
  width, or half of it, in turn (where there is one).
* A probe at a wider width is kept when its extra connections each moved at least ``WIDEN`` of
  what one connection of the current width moves (a doubling: 1.5x as fast as the recent
  batches at the current width); a probe at a narrower width when the current width's extra
  connections each move less than ``NARROW`` of one of its (a halving: the current width less
  than 1.3x as fast). Between the two the width stays: a noisy measurement near the boundary
  does not flip it back and forth.
* A probe that is kept sets the gap to the next one back to ``FIRST_GAP`` and the next probe goes
  the same way; one that is not doubles the gap (up to ``MAX_GAP`` batches) and the next probe
  tries the other way. The width settles in a few batches and is rechecked now and then after,
  so a link whose cap changes is followed.

A batch's rate is its bytes over its time from the first send to the last reply (a read's: to
the last value its caller took). That includes the caller producing (or consuming) its values
where that is the slower part, as it should: more connections that only wait for the caller are
no faster.
"""

from __future__ import annotations

import threading

MEASURED_BYTES = 4 << 20  # a batch smaller than this neither probes nor updates a rate
# What the connections a wider width adds must each carry, as a share of what one of the current
# width's carries: 0.5 keeps a doubling that moves bytes 1.5x as fast, 4 to 6 connections at 1.25x.
WIDEN = 0.5
# ... and below which share the current width's extra connections are given up (1.3x for a doubling).
NARROW = 0.3
FIRST_GAP = 2  # measured batches at the current width before the next probe, after a change
MAX_GAP = 64  # ... and at most, after probes that changed nothing


class Spread:
    """The connections per server of the next batch (``width``) and what each measured
    batch taught (``measured``). ``most`` is the widest allowed; a store that does not adapt
    always gets ``most``. Thread-safe: batches may run at once from several threads."""

    def __init__(self, most: int, *, adaptive: bool = True) -> None:
        if most < 1:
            raise ValueError(f"most={most}: at least one connection")
        self.most = most
        self.adaptive = adaptive
        self._current = 1 if adaptive else most
        self._rate = 0.0  # bytes/s of recent measured batches at the current width (0: none yet)
        self._tried: set[int] = set()  # widths a measured batch ran at: their connections are open
        self._probe = 0  # the width of the probe handed out and not yet measured (0: none)
        self._gap = FIRST_GAP
        self._since_probe = 0
        self._wider_next = True  # which neighbour the next probe tries, where both exist
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        """The width batches run at between probes."""
        return self._current

    def width(self, cap: int | None = None) -> int:
        """The connections per server for the next batch, at most ``cap`` (a batch whose servers
        share out fewer connections): the current width, or a neighbour when a probe is due."""
        limit = self.most if cap is None else max(1, min(cap, self.most))
        with self._lock:
            if self.adaptive and self._rate and self._since_probe >= self._gap:
                wider, narrower = min(self._current * 2, self.most), max(self._current // 2, 1)
                for probe in (wider, narrower) if self._wider_next else (narrower, wider):
                    if probe != self._current and probe <= limit:
                        self._probe = probe
                        return probe
            return min(self._current, limit)

    def measured(self, width: int, values: int, nbytes: int, seconds: float) -> None:
        """A batch of ``values`` values, ``nbytes`` in all, ran at ``width`` connections per
        server in ``seconds``. A batch at neither the current width nor the probe's (one ``cap``
        narrowed) teaches nothing."""
        if not self.adaptive or nbytes < MEASURED_BYTES or values < min(2 * self._current, self.most) \
                or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            if width not in self._tried:
                # The first batch at a width paid for opening its connections (and, on a real
                # network, TCP's slow start): a warm-up. A probe's is handed out again next.
                self._tried.add(width)
                if width == self._probe:
                    self._probe = 0
            elif width == self._current:
                self._rate = rate if not self._rate else (self._rate + rate) / 2
                self._since_probe += 1
            elif width == self._probe:
                self._probe, self._since_probe = 0, 0
                if _pays(width, rate, self._current, self._rate, WIDEN) if width > self._current \
                        else not _pays(self._current, self._rate, width, rate, NARROW):
                    # Kept: the next probe goes on the same way (a capped link takes a few doublings).
                    self._current, self._rate, self._gap = width, rate, FIRST_GAP
                else:
                    self._gap = min(self._gap * 2, MAX_GAP)
                    self._wider_next = not self._wider_next


def _pays(wide: int, wide_rate: float, narrow: int, narrow_rate: float, share: float) -> bool:
    """Whether the ``wide - narrow`` extra connections each carried at least ``share`` of what
    one of ``narrow``'s carried."""
    return wide_rate >= narrow_rate * (1 + share * (wide / narrow - 1))
