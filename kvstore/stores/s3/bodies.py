"""The bytes of S3 requests and replies: a value sent as the file botocore streams a body from
(``request_body``, no join of a value in pieces), and a value received by ranged GETs into one
lease (``Fetch``), released only once no GET writes into it any more, and hashed as it lands
(``PartsDigest``): the record decoder compares the digest instead of reading the value again."""

from __future__ import annotations

import bisect
import io
import itertools
import threading
from concurrent.futures import Future, wait
from typing import Any

from kvstore.buffers import ArrivalDigest, Lease, Pieces
from kvstore.errors import StoreUnavailableError
from kvstore.stores.base import WriteValue


class PiecesBody(io.RawIOBase):
    """A ``Pieces`` value as the seekable file botocore streams a body from (no join). A read
    starts at the part holding the position (a value sent from a paged cache's blocks is a
    thousand parts)."""

    def __init__(self, pieces: Pieces) -> None:
        self._parts = pieces.parts
        self._starts = list(itertools.accumulate((len(p) for p in self._parts), initial=0))
        self._size = pieces.nbytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        index = bisect.bisect_right(self._starts, self._pos) - 1
        while written < len(out) and index < len(self._parts):
            part, lo = self._parts[index], self._pos - self._starts[index]
            n = min(len(part) - lo, len(out) - written)
            out[written:written + n] = part[lo:lo + n]
            written += n
            self._pos += n
            index += 1
        return written


def request_body(value: WriteValue) -> bytes | bytearray | PiecesBody:
    """``value`` in a form botocore sends as is; it takes bytes, bytearray and files, not memoryview."""
    if isinstance(value, Pieces):
        return PiecesBody(value)
    if isinstance(value, (bytes, bytearray)):
        return value
    view = memoryview(value)
    base = view.obj
    if isinstance(base, (bytes, bytearray)) and view.contiguous and view.nbytes == len(base):
        return base  # a view of a whole buffer: send the buffer itself
    return view.tobytes()


class PartsDigest:
    """The ``ArrivalDigest`` of a value received in parts that land in any order: the first
    part is fed slice by slice as it is received (``arrived``, in its reader's CPU cache); each
    later part is fed by ``landed(index)`` once it and every part before it are in, by
    whichever reader completes the run (one at a time: xxh3 is a sequential hash)."""

    def __init__(self, view: memoryview, bounds: list[tuple[int, int]]) -> None:
        self._arrival = ArrivalDigest(len(view))
        self._view = view
        self._bounds = bounds  # (start, stop) of each part after the first, in order
        self._landed = [False] * len(bounds)
        self._next = 0  # the first part not yet hashed
        self._busy = False  # a reader is hashing
        self._lock = threading.Lock()

    def arrived(self, piece: memoryview) -> None:
        """The first part's next bytes, in order, before any later part lands."""
        self._arrival.arrived(piece)

    def landed(self, index: int) -> None:
        """Part ``index`` (of ``bounds``) is wholly in the buffer."""
        with self._lock:
            self._landed[index] = True
            if self._busy:
                return  # the reader hashing now takes this part too, if it is next
            self._busy = True
        while True:
            with self._lock:
                k = self._next
                if k >= len(self._bounds) or not self._landed[k]:
                    self._busy = False
                    return
                self._next = k + 1
            start, stop = self._bounds[k]
            self._arrival.arrived(self._view[start:stop])

    def digest(self) -> bytes | None:
        """The digest once every part has landed (``ArrivalDigest.digest``); None before."""
        with self._lock:
            complete = self._next == len(self._bounds) and not self._busy
        return self._arrival.digest() if complete else None


class Fetch:
    """One value being received by ``get_into``: its lease, the ranged GETs still filling it,
    and its digest as the parts land."""

    def __init__(self, lease: Lease, parts: list[Future[None]], digest: PartsDigest | None = None) -> None:
        self.lease = lease
        self.parts = parts
        self.digest = digest

    def release(self, wait_for: float = 0.0) -> None:
        """Give the lease back once no GET writes into it: pending ones are cancelled, running
        ones are waited for up to ``wait_for`` seconds, and release it when the last of them
        ends if they are still running then."""
        running = [p for p in self.parts if not p.cancel() and not p.done()]
        if running and wait_for > 0:
            wait(running, timeout=wait_for)
            running = [p for p in running if not p.done()]
        if not running:
            self.lease.release()
            return
        left = [len(running)]
        lock = threading.Lock()

        def one_done(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.lease.release()

        for p in running:
            p.add_done_callback(one_done)


def abandon(first: Future[Fetch | None]) -> None:
    """A value the consumer never took: release it whenever its first GET ends."""
    if first.cancelled() or first.exception() is not None:
        return
    fetch = first.result()
    if fetch is not None:
        fetch.release()


def object_size(content_range: str | None, length: int) -> int:
    """The whole object's size from a ranged GET's ``Content-Range: bytes 0-N/SIZE`` (a server
    that ignores the range sends the whole object: then its length)."""
    if not content_range:
        return length
    total = content_range.rpartition("/")[2]
    if not total.isdigit() or int(total) < length:
        raise StoreUnavailableError(f"unexpected Content-Range {content_range!r} for {length} bytes")
    return int(total)
