"""The private parts of redis-py that the Redis store relies on, in one place.

redis-py copies every large value before sending it and reads every reply through a growing
buffer; the Redis store avoids both, which needs three things redis-py does not promise:

* ``AbstractConnection._construct_command_packer`` (the hook that picks the command packer) and
  the connection's ``_buffer_cutoff`` and ``encoder``: ``ZeroCopyPacker`` sends large
  arguments as they are;
* ``Connection._sock``, the connected socket: ``DirectReplies`` reads GET replies from it
  straight into buffers of their final size;
* ``PythonRespSerializer`` and ``HiredisRespSerializer`` in ``redis.connection``;
* ``ClusterPipeline.send_cluster_commands`` and its execution strategy's ``command_queue``: the
  cluster store runs a pipeline without redis-py's per-command retries (``cluster_pipeline_commands``).

``check_redis_py()`` verifies all of them and names what is missing; the store calls it when it
first connects and ``tests/test_redis_hooks.py`` runs it against the installed redis-py, so an
upgrade that changes them fails loudly instead of silently losing speed or correctness.
"""

from __future__ import annotations

import bisect
import itertools
import ssl
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
import redis.cluster
from redis.connection import PythonRespSerializer

from kvstore.buffers import IOV_MAX, ArrivalDigest, Pieces, byte_view, io_batches, write_all
from kvstore.types import Buffer, array_view

if TYPE_CHECKING:
    from redis._parsers import Encoder

try:  # hiredis packs small commands faster than Python; redis-py works without it
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover - older redis-py
    HIREDIS_AVAILABLE = False

__all__ = ["Connection", "SSLConnection", "UnixConnection", "DirectReplies", "ZeroCopyPacker", "wire", "cluster_pipeline_commands",
           "raw_socket", "check_redis_py", "HUGE_VALUE", "pack_command", "send_all"]

#: Values at least this large are received into numpy buffers (transparent huge pages).
HUGE_VALUE = 1 << 20
_JOIN_CUTOFF = 1 << 14  # smaller command arguments are joined into one buffer (fewer buffers to send)
_RECV_SLICE = 1 << 20  # a hashed reply is received in slices the hash reads while still in the CPU's cache


def check_redis_py() -> None:
    """``RuntimeError`` naming what is missing unless redis-py still has the parts used here."""
    missing = []
    base = getattr(redis.connection, "AbstractConnection", None)
    if base is None or not callable(getattr(base, "_construct_command_packer", None)):
        missing.append("redis.connection.AbstractConnection._construct_command_packer")
    try:
        probe = redis.Connection()  # type: ignore[no-untyped-call]  # redis-py leaves Connection.__init__ unannotated
    except Exception as exc:  # noqa: BLE001 - a changed constructor is a missing hook too
        missing.append(f"redis.Connection() ({type(exc).__name__}: {exc})")
    else:
        for attr in ("_buffer_cutoff", "encoder", "_sock", "pack_commands", "send_packed_command", "disconnect"):
            if not hasattr(probe, attr):
                missing.append(f"redis.Connection.{attr}")
    if not callable(getattr(PythonRespSerializer, "pack", None)):
        missing.append("redis.connection.PythonRespSerializer.pack")
    pipeline = getattr(redis.cluster, "ClusterPipeline", None)
    if pipeline is None or not callable(getattr(pipeline, "send_cluster_commands", None)):
        missing.append("redis.cluster.ClusterPipeline.send_cluster_commands")
    for name in ("MovedError", "AskError"):
        if not hasattr(redis.exceptions, name):
            missing.append(f"redis.exceptions.{name}")
    if missing:
        raise RuntimeError(f"redis-py {redis.__version__} lacks what kvstore's Redis store uses: "
                           + ", ".join(missing) + "; pin redis to a version kvstore supports")


def cluster_pipeline_commands(pipe: Any) -> list[Any]:
    """The commands queued in a redis-py ``ClusterPipeline`` (``send_cluster_commands``' stack)."""
    try:
        queue: list[Any] = pipe._execution_strategy.command_queue
    except AttributeError as exc:
        raise RuntimeError(f"redis-py {redis.__version__}: a ClusterPipeline without an execution strategy's "
                           "command_queue; pin redis to a version kvstore supports") from exc
    return queue


def raw_socket(conn: Any) -> Any:
    """The connected socket of a redis-py connection (``ConnectionError`` if it has none)."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise redis.exceptions.ConnectionError("connection has no socket")
    return sock


class ZeroCopyPacker:
    """Packs commands for the wire; large arguments are sent as they are, never joined.

    Small commands (lookups, deletes) go through hiredis' C packer. A command with an argument
    over the cutoff is packed as a list ``[header, value, CRLF+next header, ...]`` whose value
    pieces are the caller's own buffers: the connection ``sendall``s them one by one.
    """

    def __init__(self, buffer_cutoff: int, encode: Any) -> None:
        self._cutoff = buffer_cutoff
        self._python = PythonRespSerializer(buffer_cutoff, encode)
        hiredis_packer: Any = HiredisRespSerializer  # its constructor is annotated in some redis-py releases only
        self._small = hiredis_packer() if HIREDIS_AVAILABLE else self._python

    def pack(self, *args: Any) -> list[Any]:
        cutoff = self._cutoff
        for arg in args:
            if isinstance(arg, Pieces):  # redis-py sends what it gets: the pieces' own buffers
                return list(_buffers(pack_command(*args)))
            if isinstance(arg, (bytes, bytearray, memoryview)) and len(arg) > cutoff:
                packed: list[Any] = self._python.pack(*args)  # type: ignore[no-untyped-call]  # untyped in redis-py
                return packed
        small: list[Any] = self._small.pack(*args)
        return small


def _bulk(arg: Any) -> Any:
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int):
        return str(arg).encode()
    return arg


def pack_command(*args: Any) -> list[Any]:
    """One RESP command as the buffers to ``send_all`` in order: small parts joined, large
    arguments passed through as they are (no copy), a ``Pieces`` argument as itself, so that
    ``send_all`` streams it (its trailer is computed as its bytes are sent)."""
    if all(type(arg) is str for arg in args):  # GET, EXISTS, DEL of keys: the lookups' and loads' common case
        encoded = [arg.encode() for arg in args]
        return [b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(e), e) for e in encoded)]
    out: list[Any] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        value = _bulk(arg)
        if isinstance(value, Pieces):
            head.append(b"$%d\r\n" % value.nbytes)
            out.append(b"".join(head))
            out.append(value)
            head = [b"\r\n"]
            continue
        view = byte_view(value)
        if len(view) > _JOIN_CUTOFF:
            head.append(b"$%d\r\n" % len(view))
            out.append(b"".join(head))
            out.append(view)
            head = [b"\r\n"]
        else:
            head += [b"$%d\r\n" % len(view), bytes(view), b"\r\n"]
    out.append(b"".join(head))
    return out


class _PackerMixin:
    # Set by redis-py's connection __init__, in the class this is mixed into.
    _buffer_cutoff: int
    encoder: Encoder

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer if packer is not None else ZeroCopyPacker(self._buffer_cutoff, self.encoder.encode)


class Connection(_PackerMixin, redis.Connection):
    pass


class SSLConnection(_PackerMixin, redis.SSLConnection):
    pass


class UnixConnection(_PackerMixin, redis.UnixDomainSocketConnection):
    pass


def wire(value: Buffer) -> bytes | memoryview:
    """``value`` as a byte-addressed buffer whose ``len`` is its size in bytes (RESP needs that)."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class DirectReplies:
    """Reads GET replies (RESP2 or RESP3) from a socket straight into buffers of their final size.

    redis-py hands every reply to hiredis, whose buffer grows by reallocation and is then copied
    into a new ``bytes``: three copies of a 32 MiB value. Here the bulk header is parsed and the
    value is received with ``recv_into`` into one new buffer: one write per byte. Values come back
    as memoryviews of that buffer (the caller owns it). Only used right
    after sending GETs on a connection whose parser holds nothing (request/response order).
    """

    _HEADER_READ = 1 << 16

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()
        # Scattered receives: plain sockets (an SSL socket has no recvmsg_into).
        self._scatter = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "recvmsg_into")
        #: After ``value(hashed=True)``: the value's ``ArrivalDigest`` (None if too short).
        self.digest: bytes | None = None

    def _fill(self) -> None:
        chunk = self._sock.recv(self._HEADER_READ)
        if not chunk:
            raise redis.exceptions.ConnectionError("server closed the connection mid-reply")
        self._buf += chunk

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def value(self, into: Callable[[int], memoryview] | None = None, *, hashed: bool = False,
              land: Callable[[memoryview], Iterator[Sequence[memoryview]]] | None = None) -> memoryview | None:
        """The next GET reply's value (``None`` for a miss), received into ``into(size)`` when
        given (a leased buffer of exactly ``size`` bytes), else into a new buffer. With
        ``hashed`` the value is received in slices, each hashed right after it lands
        (``ArrivalDigest``, left in ``self.digest``). With ``land`` the bytes go, in order, to
        the buffers of the sequences ``land(view)`` yields (each filled before the next is asked
        for), which must hold exactly the value; ``view`` is still returned."""
        line = self._line()
        kind = line[:1]
        if kind == b"_" or line == b"$-1":
            return None
        if kind != b"$":
            raise _unexpected(line, "GET")
        size = int(line[1:])
        if into is not None:
            view = into(size)
        else:
            # A fresh buffer over glibc's mmap threshold page-faults per 4 KiB page; numpy asks
            # the kernel for transparent huge pages, which fault far less often.
            view = array_view(np.empty(size, dtype=np.uint8)) if size >= HUGE_VALUE else memoryview(bytearray(size))
        arrival = ArrivalDigest(size) if hashed else None
        if land is None:
            self._receive((view,), arrival)
        else:
            landed = 0
            for targets in land(view):
                landed += sum(map(len, targets))
                if landed > size:
                    raise ValueError(f"the landing buffers exceed the {size}-byte value")
                self._receive(targets, arrival)
            if landed != size:
                raise ValueError(f"the landing buffers hold {landed} bytes of a {size}-byte value")
        self.digest = arrival.digest() if arrival is not None else None
        while len(self._buf) < 2:  # the CRLF after the value
            self._fill()
        del self._buf[:2]
        return view

    def _receive(self, views: Sequence[memoryview], arrival: ArrivalDigest | None) -> None:
        """Fill ``views``, in order, with the reply's next bytes: buffered ones first, then
        straight from the socket, several buffers per system call (``recvmsg_into``; one at a
        time over TLS), at most ``_RECV_SLICE`` bytes per call so that the hash reads each slice
        while it is still in the CPU's cache."""
        i, at = 0, 0  # the buffer being filled, and how much of it is
        while i < len(views) and self._buf:
            v = views[i]
            take = min(len(v) - at, len(self._buf))
            if take:
                v[at:at + take] = self._buf[:take]
                del self._buf[:take]
                if arrival is not None:
                    arrival.arrived(v[at:at + take])
            at += take
            if at == len(v):
                i, at = i + 1, 0
        # Scattered: each call asks for the views that fit in one slice (whole, the first from
        # where it stands); the list is cut from ``views`` and the hash walks only what arrived.
        count = len(views)
        sizes = list(map(len, views)) if self._scatter and count - i > 1 else None
        ends = list(itertools.accumulate(sizes)) if sizes is not None else None
        while i < count:
            v = views[i]
            if at == len(v):
                i, at = i + 1, 0
                continue
            j = i + 1
            if ends is not None and len(v) - at < _RECV_SLICE:
                j = bisect.bisect_right(ends, ends[i] - len(v) + at + _RECV_SLICE, i + 1, min(count, i + IOV_MAX))
            if j == i + 1 or sizes is None:
                stop = len(v) if arrival is None else min(len(v), at + _RECV_SLICE)
                n = self._sock.recv_into(v[at:stop])
                if not n:
                    raise redis.exceptions.ConnectionError("server closed the connection mid-value")
                if arrival is not None:
                    arrival.arrived(v[at:at + n])
                at += n
                continue
            first = v[at:]
            n = self._sock.recvmsg_into([first, *views[i + 1:j]])[0]
            if not n:
                raise redis.exceptions.ConnectionError("server closed the connection mid-value")
            rest = sizes[i] - at
            if n < rest:
                if arrival is not None:
                    arrival.arrived(first[:n])
                at += n
                continue
            if arrival is not None:
                arrival.arrived(first)
            n -= rest
            i, at = i + 1, 0
            while n:  # views i, i+1, ... were filled whole, the last one perhaps in part
                size = sizes[i]
                if n < size:
                    if arrival is not None:
                        arrival.arrived(views[i][:n])
                    at = n
                    break
                if arrival is not None:
                    arrival.arrived(views[i])
                n -= size
                i += 1

    def integers(self, count: int) -> list[int]:
        """Read ``count`` integer replies (EXISTS, DEL); an error reply raises ``ResponseError``."""
        out = []
        for _ in range(count):
            line = self._line()
            if line[:1] != b":":
                raise _unexpected(line, "EXISTS or DEL")
            out.append(int(line[1:]))
        return out

    def status(self) -> None:
        """Read one simple reply (``+OK`` of a SET); an error reply raises ``ResponseError``."""
        line = self._line()
        if line[:1] not in (b"+", b"$", b":", b"_"):
            raise _unexpected(line, "SET")


def _unexpected(line: bytes, command: str) -> Exception:
    """What a reply line a reader cannot take means: the server's error (``ResponseError``), or
    a reply ``command`` never gets (``InvalidResponse``)."""
    if line[:1] == b"-":
        return redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
    return redis.exceptions.InvalidResponse(f"unexpected reply to {command}: {line[:40]!r}")


def _buffers(packed: Iterable[Any]) -> Iterator[Any]:
    """The buffers of packed commands, each ``Pieces`` streamed (sliced, its trailer last)."""
    for buf in packed:
        if isinstance(buf, Pieces):
            yield from buf.stream()
        else:
            yield buf


def send_all(sock: Any, buffers: Sequence[Any]) -> None:
    """Send every buffer of packed commands in order, many per ``sendmsg`` (``io_batches``: a
    record sent straight from a paged cache's blocks is a thousand small parts); a ``Pieces`` is
    streamed, so its trailer is computed as its bytes leave. A TLS socket has no ``sendmsg``:
    there small neighbours are joined and each large buffer goes by ``sendall``."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        _send_joined(sock, buffers)
        return
    for batch in io_batches(_buffers(buffers)):
        write_all(sock.sendmsg, batch)  # the socket's timeout raises only when nothing moves


def _send_joined(sock: Any, buffers: Sequence[Any]) -> None:
    pending: list[Any] = []
    for buf in _buffers(buffers):
        if len(buf) <= _JOIN_CUTOFF:
            pending.append(buf)
            continue
        if pending:
            sock.sendall(b"".join(pending))
            pending = []
        sock.sendall(buf)
    if pending:
        sock.sendall(b"".join(pending))
