"""``RecordingStreams``: the device path's streams on the CPU, every call noted in order, so that
what a CUDA load or save asks of its streams (``kvstore.paged.streams``) is tested without a
GPU: which stream each copy runs on, what waits for what, and where the host waits.

Install it on a transfer's copy path (``install(transfer)``) before a load or save; ``calls``
then holds ``(name, detail)`` in order, with a mark's number as its detail where there is one:

* ``("slots", "side")`` the slots went to the device for the side stream (host slots: from
  pinned memory, non-blocking; device slots: the side stream waits for the caller's stream);
* ``("h2d", "copy, pinned")`` / ``("h2d", "copy, pageable")`` a record's DMA on the copy stream;
* ``("d2h", n)`` a copy back to the host on the side stream, its mark ``n``;
* ``("copies_done", n)`` / ``("side_done", n)`` a mark on the copy / side stream;
* ``("side_waits", n)`` / ``("copy_waits", n)`` a stream waits for mark ``n`` (None: nothing);
* ``("side_waits_for_compute", None)``, ``("compute_waits_for_side", None)``;
* ``("side", "enter")`` / ``("side", "exit")`` work issued on the side stream (gathers, scatters);
* ``("host_waits", n)`` the host waits for mark ``n``.

The copies themselves run at once (the CPU has no streams): the record is of the order asked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvstore.paged.streams import Mark, Streams

__all__ = ["RecordingStreams", "install"]


class RecordingStreams(Streams):
    """``Streams`` on the CPU that notes every call (module docstring). Thread-safe."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(torch.device(device))
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._marks = 0

    def note(self, name: str, detail: Any = None) -> None:
        with self._lock:
            self.calls.append((name, detail))

    def _mark(self) -> int:
        with self._lock:
            self._marks += 1
            return self._marks

    @contextmanager
    def side(self) -> Iterator[None]:
        self.note("side", "enter")
        try:
            yield
        finally:
            self.note("side", "exit")

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        self.note("slots", "side")
        return super().slots(slots)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> None:
        self.note("h2d", "copy, pinned" if pinned else "copy, pageable")
        super().h2d(dst, src, pinned=pinned)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> Mark:
        super().d2h(dst, src, pinned=pinned)
        mark = self._mark()
        self.note("d2h", mark)
        return mark

    def copies_done(self) -> Mark:
        mark = self._mark()
        self.note("copies_done", mark)
        return mark

    def side_done(self) -> Mark:
        mark = self._mark()
        self.note("side_done", mark)
        return mark

    def side_waits(self, mark: Mark) -> None:
        self.note("side_waits", mark)

    def copy_waits(self, mark: Mark) -> None:
        self.note("copy_waits", mark)

    def side_waits_for_compute(self) -> None:
        self.note("side_waits_for_compute")

    def compute_waits_for_side(self) -> None:
        self.note("compute_waits_for_side")

    def host_waits(self, mark: Mark) -> None:
        self.note("host_waits", mark)

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.calls]


def install(transfer: Any) -> RecordingStreams:
    """A ``RecordingStreams`` put in place of ``transfer``'s copy path's streams (a ``KVTransfer``
    on the device path, or a ``DeviceCopies``); returned."""
    copies = getattr(transfer, "copies", transfer)
    streams = RecordingStreams(copies.device)
    copies.streams = streams
    return streams
