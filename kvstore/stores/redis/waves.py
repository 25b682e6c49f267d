"""How far a batch of GETs may request ahead: one budget of reply bytes for all its connections.

Redis builds the reply of every command it has read before it sends any of it, and it reads
every connection's commands in one pass of its event loop. So the bytes a batch has requested
but not yet received are bytes the server copies before a socket hears anything. With four
connections each asking for a 32 MiB value at once, the last socket waits for 128 MiB of
copying, which is a long silence on a busy server and a read deadline missed. A window per
connection would multiply that silence by the number of connections. ``Waves`` bounds the batch
instead, one per server: a batch over several servers (shards, a cluster's nodes) keeps one
``Waves`` for each server's keys (``indices``), since each builds only its own replies and each
needs its own next value in flight. One frontier over the whole batch left a server idle whenever
the values next in line were another server's, and kept one value in flight per server where the
raw client keeps two on each: 0.70-0.85x of its loads at 2 servers, 0.82-0.92x with a budget per
server (benchmarks/results/redis_servers.md).

The bound has two parts. ``budget`` is what the server can build while its replies stay in its
CPU's cache: replies built further ahead are evicted before the socket sends them and read back
from memory, so requesting every 3 MiB value of a batch at once runs at half the speed of two at
a time (benchmarks/results/peer_lmcache.md, run 12). At least two values are requested (one on
the wire while the next is built) and at least one per connection (each connection's link
carries its own share), unless that passes ``limit``, the silence a socket may wait through.
Value ``j`` may be requested once ``j < received + ahead``. Before the first reply the size is
the caller's hint (the store's previous batch), or unknown, and then only value 0 may be
requested. Each connection requests its own values (value ``j`` on connection ``j mod N``) up
to that frontier, so consecutive values arrive on different sockets at once, in the order a
consumer takes them.

The batch also starts small: one value per connection, then as many more as have arrived. The
first values then reach the consumer after one value's worth of server work instead of the
whole budget's, and their verification and copying overlap the transfer of the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Cancelled(Exception):
    """The batch was abandoned (by its consumer, or because another connection failed)."""


def requested_ahead(size: int, budget: int, limit: int, connections: int = 1) -> int:
    """How many values of ``size`` bytes a batch keeps requested and not yet received: as many
    as ``budget`` holds, at least two and at least one per connection, at most as many as
    ``limit`` holds, and never fewer than one (the module docstring says why)."""
    return max(1, min(limit // size, max(budget // size, 2, connections)))


class Waves:
    """The frontier of a batch of ``n`` GETs (or of those of its ``indices`` one server holds):
    the values below it may be requested.

    ``budget`` and ``limit`` are in bytes of replies requested and not yet received
    (``requested_ahead``; ``limit`` defaults to ``budget``; a ``budget`` of ``None``: every value
    at once). ``received(size)`` is called after each reply. ``frontier(waiting_for=j)`` blocks
    until value ``j`` may be requested. ``cancel()`` wakes every waiting connection, whose next
    call raises ``Cancelled``.
    """

    def __init__(self, n: int, budget: int | None, size_hint: int = 0, connections: int = 1,
                 limit: int | None = None, indices: Sequence[int] | None = None) -> None:
        # ``indices``: the values of a batch of ``n`` that this one governs (one server's, in
        # order); frontiers are in batch indices, progress is counted in positions among them.
        self._indices = list(range(n)) if indices is None else list(indices)
        self._position = {j: p for p, j in enumerate(self._indices)}
        self._end = self._indices[-1] + 1 if self._indices else 0
        self._n, self._budget, self._connections = len(self._indices), budget, max(1, connections)
        self._limit = limit if limit is not None else (budget or 0)
        self._cond = threading.Condition()
        self._received = 0
        self._size = size_hint  # the largest reply seen (or hinted): the estimate for the rest
        self._cancelled = False

    @property
    def size(self) -> int:
        """The largest reply size seen or hinted (0: none yet), a hint for the next batch."""
        return self._size

    def _frontier(self) -> int:
        if self._budget is None:
            return self._n
        if self._size == 0:
            ahead = 1
        else:  # reached by a ramp that starts at one value per connection
            most = requested_ahead(self._size, self._budget, self._limit, self._connections)
            ahead = min(most, self._connections + self._received)
        return min(self._n, self._received + ahead)

    def frontier(self, waiting_for: int | None = None) -> int:
        position = None if waiting_for is None else self._position[waiting_for]
        with self._cond:
            while True:
                if self._cancelled:
                    raise Cancelled
                limit = self._frontier()
                if position is None or position < limit:
                    return self._indices[limit] if limit < self._n else self._end
                self._cond.wait()

    def received(self, size: int) -> None:
        with self._cond:
            self._received += 1
            self._size = max(self._size, size, 1)  # a miss too: the first reply ends the one-value wave
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
