"""A minimal zero-copy RESP client: the raw ceiling that Redis numbers are compared against.

``RawRedis(host, port)`` speaks just enough of the Redis protocol to move large values the
cheapest way Python can: ``set(key, *pieces)`` sends the command header, then each piece as it
is (``sendall`` of a memoryview: no join, no copy), and ``get_into(key, buffer)`` receives the
value with ``recv_into`` straight into a buffer the caller preallocated. ``set_many`` and
``get_many_into`` pipeline a batch (all commands out, then all replies in; or, with ``ahead``,
only that many GETs ahead of the reply being read: ``store_window`` gives the store's). Both take
a value scattered over many buffers (a paged cache's blocks): ``set_many(scatter=True)`` sends
them with ``sendmsg``, many per call, and a sequence of buffers given to ``get_many_into`` is
filled with ``recvmsg_into``: the least a client moving a record from or into the blocks
spends, with no copy and no checksum. There is no
connection pool, no retry, no cluster or TLS support: it is a measuring stick for benchmarks
(``kvstore bench``, ``benchmarks/``), not a client to build on.

Errors: ``RawRedisError`` for an error reply (``-ERR ...``), ``OSError`` (``ConnectionError``,
``TimeoutError``) for the socket. A value larger than the buffer handed to ``get_into`` (or not
filling a list of buffers exactly) raises
``ValueError`` after the value was read off the socket, so the connection stays usable.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.buffers import io_batches, write_all

__all__ = ["RawRedis", "RawRedisError", "store_window"]

_CRLF = b"\r\n"
_SMALL = 64 * 1024  # pieces below this are coalesced into one send; larger ones go out as they are
_READ = 256 * 1024
_SLICE = 1 << 20  # with before_send: small enough to still be in the CPU's cache when it is sent


def store_window(size: int, connections: int = 1) -> int:
    """GETs of ``size``-byte values to keep requested ahead on each of ``connections``
    connections (``get_many_into``'s ``ahead``): what ``RedisStore``'s reads keep ahead of a
    batch on one server (``waves.requested_ahead`` with the store's budget and limit), shared
    out over the connections. A ceiling that asks for more at once than the store does is no
    ceiling: the replies it makes the server build leave the server's CPU cache before they
    are sent (``benchmarks/results/peer_lmcache.md``, run 12)."""
    from kvstore.stores.redis.base import _IN_FLIGHT_BYTES, _IN_FLIGHT_LIMIT  # redis-py: only when asked
    from kvstore.stores.redis.waves import requested_ahead

    ahead = requested_ahead(size, _IN_FLIGHT_BYTES, _IN_FLIGHT_LIMIT, connections)
    return max(1, -(-ahead // connections))


class RawRedisError(Exception):
    """The server answered a command with an error reply."""


def _view(piece: Any) -> memoryview:
    view = memoryview(piece)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class RawRedis:
    """One TCP connection to a Redis (or Valkey) server; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *, password: str | None = None,
                 username: str | None = None, db: int = 0, timeout: float = 10.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray(_READ)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0
        self._out = bytearray()
        if password:
            self._call(b"AUTH", *([username.encode()] if username else []), password.encode())
        if db:
            self._call(b"SELECT", str(db).encode())

    # -- commands ------------------------------------------------------------------------------
    def ping(self) -> bool:
        return bool(self._call(b"PING") == "PONG")

    def set(self, key: str | bytes, *pieces: Any) -> None:
        """``SET key <pieces joined>`` without joining them: each piece is sent as it is."""
        self._queue_set(key, pieces)
        self._flush()
        self._read_reply()

    def get_into(self, key: str | bytes, buffer: Any) -> int | None:
        """Receive the value of ``key`` into ``buffer`` (writable); its length, or ``None`` if absent."""
        self._queue(b"GET", _key_bytes(key))
        self._flush()
        return self._read_bulk_into(_view(buffer))

    def set_many(self, items: Iterable[tuple[str | bytes, Any]], *,
                 before_send: Callable[[memoryview], object] | None = None, scatter: bool = False) -> None:
        """Pipelined ``SET`` of ``(key, value)`` pairs; a value may be one buffer or a tuple of pieces.
        With ``before_send`` large pieces go out in slices of 1 MiB, each handed to it right before
        it is sent (what a checksum computed as the bytes leave would cost: ``bench_save_split``).
        With ``scatter`` every piece goes out as it is, small ones too, many per ``sendmsg``
        (``before_send`` is not called)."""
        n = 0
        if scatter:
            views: list[memoryview] = []
            for key, value in items:
                pieces = [_view(p) for p in (value if isinstance(value, (tuple, list)) else (value,))]
                k = _key_bytes(key)
                views.append(memoryview(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                                        % (len(k), k, sum(v.nbytes for v in pieces))))
                views.extend(pieces)
                views.append(memoryview(_CRLF))
                n += 1
            self._flush()
            for batch in io_batches(views):
                write_all(self._sock.sendmsg, batch)
        else:
            for key, value in items:
                self._queue_set(key, value if isinstance(value, (tuple, list)) else (value,), before_send)
                n += 1
        self._flush()
        errors = []
        for _ in range(n):  # read every reply, so the connection stays in step, then report
            try:
                self._read_reply()
            except RawRedisError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def get_many_into(self, keys: Sequence[str | bytes], buffers: Sequence[Any], *,
                      ahead: int | None = None) -> list[int | None]:
        """Pipelined ``GET``s, each value into its own buffer, or into a list or tuple of buffers
        filled in order (``recvmsg_into``); lengths, ``None`` for absent keys.

        All at once by default. With ``ahead``, that many GETs are kept requested ahead of the
        reply being read: sent all at once, the server builds every reply before it sends the
        first byte (it reads all of a connection's commands in one pass), so the client waits
        through all of that copying with nothing to receive; with a window the server builds
        reply i+1 while reply i is on the wire."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        ahead = len(keys) if ahead is None else max(1, ahead)
        for key in keys[:ahead]:
            self._queue(b"GET", _key_bytes(key))
        self._flush()
        out: list[int | None] = []
        error: Exception | None = None
        for i, buffer in enumerate(buffers):
            if i + ahead < len(keys):
                self._queue(b"GET", _key_bytes(keys[i + ahead]))
                self._flush()
            try:
                out.append(self._read_bulk_into([_view(b) for b in buffer] if isinstance(buffer, (list, tuple))
                                                else _view(buffer)))
            except (RawRedisError, ValueError) as exc:
                error = error or exc
                out.append(None)
        if error is not None:
            raise error
        return out

    def flushall(self) -> None:
        self._call(b"FLUSHALL")

    def delete(self, *keys: str | bytes) -> int:
        return int(self._call(b"DEL", *(_key_bytes(k) for k in keys))) if keys else 0

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending -------------------------------------------------------------------------------
    def _queue(self, *args: bytes) -> None:
        self._out += b"*%d\r\n" % len(args)
        for a in args:
            self._out += b"$%d\r\n%s\r\n" % (len(a), a)

    def _queue_set(self, key: str | bytes, pieces: Sequence[Any],
                   before_send: Callable[[memoryview], object] | None = None) -> None:
        views = [_view(p) for p in pieces]
        k = _key_bytes(key)
        self._out += b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, sum(v.nbytes for v in views))
        for v in views:
            if v.nbytes < _SMALL:
                self._out += v
                if before_send is not None:
                    before_send(v)
            elif before_send is None:
                self._flush()
                self._sock.sendall(v)
            else:
                self._flush()
                for start in range(0, v.nbytes, _SLICE):
                    piece = v[start:start + _SLICE]
                    before_send(piece)
                    self._sock.sendall(piece)
        self._out += _CRLF

    def _flush(self) -> None:
        if self._out:
            self._sock.sendall(self._out)
            self._out = bytearray()

    def _call(self, *args: bytes) -> Any:
        self._queue(*args)
        self._flush()
        return self._read_reply()

    # -- receiving -----------------------------------------------------------------------------
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # compact: move the unread tail to the front
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start:self._end]
            self._start, self._end = 0, tail
        n = self._sock.recv_into(self._mv[self._end:])
        if n == 0:
            raise ConnectionError("the Redis server closed the connection")
        self._end += n

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf) - 2:
                raise ConnectionError("protocol error: reply line too long")
            self._fill()

    def _read_exact(self, target: memoryview) -> None:
        """Fill ``target`` from what is buffered, then straight from the socket."""
        have = min(self._end - self._start, target.nbytes)
        target[:have] = self._mv[self._start:self._start + have]
        self._start += have
        while have < target.nbytes:
            n = self._sock.recv_into(target[have:])
            if n == 0:
                raise ConnectionError("the Redis server closed the connection")
            have += n

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _READ)))
        while n:
            step = min(n, scratch.nbytes)
            self._read_exact(scratch[:step])
            n -= step

    def _read_exact_scattered(self, targets: list[memoryview]) -> None:
        """Fill ``targets`` in order: from what is buffered, then straight from the socket."""
        first = 0
        while first < len(targets) and self._end > self._start:
            have = min(self._end - self._start, targets[first].nbytes)
            targets[first][:have] = self._mv[self._start:self._start + have]
            self._start += have
            if have == targets[first].nbytes:
                first += 1
            else:
                targets[first] = targets[first][have:]
        rest = [t for t in targets[first:] if t.nbytes]
        if rest:
            write_all(lambda views: self._sock.recvmsg_into(views)[0], rest)

    def _read_bulk_into(self, target: memoryview | list[memoryview]) -> int | None:
        line = self._line()
        if line[:1] == b"-":
            raise RawRedisError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ConnectionError(f"protocol error: expected a bulk reply, got {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        room = target.nbytes if isinstance(target, memoryview) else sum(t.nbytes for t in target)
        if n > room or (n < room and isinstance(target, list)):
            self._skip(n + 2)
            raise ValueError(f"value of {n} bytes does not fit the {room}-byte buffer"
                             + ("s exactly" if isinstance(target, list) else ""))
        if isinstance(target, list):
            self._read_exact_scattered(target)
        else:
            self._read_exact(target[:n])
        self._skip(2)
        return n

    def _read_reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RawRedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self._read_exact(memoryview(out))
            self._skip(2)
            return bytes(out)
        if kind == b"*":
            return [self._read_reply() for _ in range(max(0, int(rest)))]
        raise ConnectionError(f"protocol error: unexpected reply {line[:40]!r}")
