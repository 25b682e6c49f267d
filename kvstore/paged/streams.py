"""The streams a device copy path orders its work on, and every call it makes to them.

``DeviceCopies`` (``kvstore.paged.device``) never touches ``torch.cuda`` itself: it asks a
``Streams`` to copy, to mark a point in a stream's work, and to make a stream or the host wait
for a mark. ``Streams`` is the contract and the host implementation (a CPU "device": every copy
is done when it returns, marks are None, waits return at once); ``CudaStreams`` is CUDA's;
``kvstore.testing.streams.RecordingStreams`` notes every call, so that the order of a load's
and a save's device work is tested on the CPU.

CUDA's promises:

* Two streams of the path's own: the **copy stream** takes the DMAs of records into device
  staging, the **side stream** the gathers, scatters and a save's copies back to the host. A
  record's DMA therefore never waits for a running forward: only the scatter does (it waits for
  the compute stream), and the compute stream waits for the scatter (``compute_waits_for_side``).
* The **compute stream** is the engine's: the current stream of the thread that built the path,
  also when a load or save runs on another thread (a background loader or saver), whose own
  current stream is the default one.
* **Slots** given on the host (as vLLM's block tables are) go to the device from pinned memory,
  non-blocking, on the side stream (``slots``): no copy on the caller's stream, which would wait
  for every forward queued there. Slots given on the device are made on the caller's stream:
  the side stream waits for it, and the allocator is told that the side stream uses them
  (``record_stream``), so memory the caller frees is not handed out while a scatter still reads it.
* **Staging** (``staging``) is allocated for the side stream and marked as used by the copy
  stream too; a buffer is reused for a DMA only after the side stream's last use of it
  (``copy_waits``).
* The host waits only for marks: a window's DMAs (its records' memory goes back), a save's copy
  of one record (it is handed to the store), never for a whole stream or the device.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["Mark", "Streams", "CudaStreams", "streams_for"]

#: A point in a stream's work (a recorded CUDA event); None where work is done when issued.
Mark = Any


class Streams:
    """The host implementation, and the contract (module docstring): on a CPU "device" every
    copy is synchronous, a mark is None and every wait returns at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def side(self) -> AbstractContextManager[Any]:
        """Work issued inside runs on the side stream (gathers, scatters)."""
        return nullcontext()

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as int64 on the device, ready for the side stream."""
        return slots.to(self.device, torch.int64)

    def staging(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8) for the side and copy streams."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> None:
        """``src`` (host) into ``dst`` (staging) on the copy stream; non-blocking from ``pinned`` memory."""
        dst.copy_(src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> Mark:
        """``src`` (staging) into ``dst`` (host) on the side stream, after the work issued there
        before; its mark (the host waits for it before reading ``dst``)."""
        dst.copy_(src)
        return None

    def copies_done(self) -> Mark:
        """A mark after the DMAs issued so far (copy stream)."""
        return None

    def side_done(self) -> Mark:
        """A mark after the side stream's work issued so far."""
        return None

    def side_waits(self, mark: Mark) -> None:
        """The side stream's next work waits for ``mark``."""

    def copy_waits(self, mark: Mark) -> None:
        """The copy stream's next work waits for ``mark``."""

    def side_waits_for_compute(self) -> None:
        """The side stream's next work waits for what is queued on the compute stream."""

    def compute_waits_for_side(self) -> None:
        """The compute stream's next work waits for what is queued on the side stream."""

    def host_waits(self, mark: Mark) -> None:
        """The host waits until ``mark``'s work is done."""

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        return None

    def compute(self) -> torch.cuda.Stream | None:
        """The compute stream (None on a device without streams)."""
        return None


class CudaStreams(Streams):
    """``Streams`` on a CUDA device (module docstring). Built on the engine's thread: its
    current stream is the compute stream."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # torch leaves torch.cuda.Stream's constructor unannotated.
        self.side_s = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.copy_s = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._engine_thread = threading.get_ident()
        self._engine_stream = torch.cuda.current_stream(device)

    def compute(self) -> torch.cuda.Stream:
        if threading.get_ident() == self._engine_thread:
            return torch.cuda.current_stream(self.device)
        return self._engine_stream

    @property
    def side_stream(self) -> torch.cuda.Stream:
        return self.side_s

    def side(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.side_s)

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.device.type == "cpu":
            host = slots.to(torch.int64).pin_memory()  # torch's pinned allocator: kept until the copy is done
            with torch.cuda.stream(self.side_s):  # allocated for the side stream, where it is read
                return host.to(self.device, non_blocking=True)
        made_on = torch.cuda.current_stream(slots.device)
        device_slots = slots.to(torch.int64)  # a new tensor (on made_on) only if it was not int64
        self.side_s.wait_stream(made_on)
        device_slots.record_stream(self.side_s)
        return device_slots

    def staging(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self.side_s):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf.record_stream(self.copy_s)  # DMAs write it too: freed only once those are done
        return buf

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> None:
        with torch.cuda.stream(self.copy_s):
            dst.copy_(src, non_blocking=pinned)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, pinned: bool) -> Mark:
        with torch.cuda.stream(self.side_s):
            dst.copy_(src, non_blocking=pinned)
        return self.side_done()

    def copies_done(self) -> Mark:
        return self.copy_s.record_event()

    def side_done(self) -> Mark:
        return self.side_s.record_event()

    def side_waits(self, mark: Mark) -> None:
        if mark is not None:
            self.side_s.wait_event(mark)

    def copy_waits(self, mark: Mark) -> None:
        if mark is not None:
            self.copy_s.wait_event(mark)

    def side_waits_for_compute(self) -> None:
        self.side_s.wait_stream(self.compute())

    def compute_waits_for_side(self) -> None:
        self.compute().wait_stream(self.side_s)

    def host_waits(self, mark: Mark) -> None:
        if mark is not None:
            mark.synchronize()


def streams_for(device: torch.device) -> Streams:
    """``CudaStreams`` on a CUDA device (call it on the engine's thread), ``Streams`` elsewhere."""
    return CudaStreams(device) if device.type == "cuda" else Streams(device)
